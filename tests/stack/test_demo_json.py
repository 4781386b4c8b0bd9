"""`ragserve up --exit-after-demo --demo-args '--json-answer ...'`: the demo asks for a JSON answer citing
passage ids (response_format json_schema) through the whole stack; every answer parses and cites only the
passages it was given."""

from __future__ import annotations

import json

from tests.helpers.stack import Up, tiny

SMALL = ("--engines", "1", "--redis", "off", "--num-gpu-blocks", "512", "--served-model-name", "tiny")
QUESTIONS = ["How do I descale the Aurora X2?", "What brew temperature does the Aurora X2 use?"]


def test_demo_json_answers_cite_only_retrieved_passages(tmp_path):
    out = tmp_path / "demo.json"
    asked = " ".join(f"--question '{q}'" for q in QUESTIONS)
    demo_args = f"--json-answer --context passages --max-tokens 24 --json {out} {asked}"
    up = Up(tmp_path, *SMALL, "--model", tiny(), "--exit-after-demo", "--demo-args", demo_args)
    try:
        assert up.proc.wait(300) == 0, up.output()[-5000:]
        assert "demo finished with exit code 0" in up.output()
        results = json.loads(out.read_text())
        assert len(results) == len(QUESTIONS)
        for r in results:
            assert r["status"] == 200 and r["error"] == "" and r["finish_reason"] == "stop", r
            answer = json.loads(r["text"])  # the raw streamed text is the JSON document
            assert answer == r["json_answer"] and set(answer) == {"answer", "cited_passages"}
            assert isinstance(answer["answer"], str) and len(answer["answer"]) <= 3 * 24
            assert len(r["passages"]) == 4 and set(answer["cited_passages"]) <= set(r["passages"])
        assert "cites:" in up.output()
    finally:
        up.cleanup()
