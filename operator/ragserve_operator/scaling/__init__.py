"""Engine-pool autoscaling, in three parts and the pass that joins them:

- pod_metrics: read each engine pod's load from its /metrics (ragserve.prom_text);
- decision: the HorizontalPodAutoscaler's algorithm on that load (pure maths, clock passed in);
- hpa_keda: autoscaling.mode hpa / keda, an HPA or KEDA ScaledObject manifest per pool instead;
- autoscale_pass: autoscaling.mode operator, one pass (read, decide, scale, record in status).

The load signals (vLLM metric, CRD target key, aggregation) are ragserve.metric_names.LOAD_METRICS.
"""
