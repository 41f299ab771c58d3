"""From settings to a served executor: the model loaded, fused and packed, the KV budget
decided (kv_budget), the self-check passed (self_check), the ModelRunner built (startup), and
serving on several ranks (tp_serve)."""
