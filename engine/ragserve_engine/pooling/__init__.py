"""The pooling runner (`ragserve engine --task embed`): encoder or decoder passes without a KV cache, batched
continuously (scheduler.py), pooled to one vector per input (model.py), served by AsyncPooler (engine.py)."""
