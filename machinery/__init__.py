"""What only the stages' machinery needs, none of the method: models.py (loading, the embedded model, the policy's
samplers: transformers, an OpenAI-compatible server, vLLM) and training.py (FSDP2, micro-batches, pi_ref's
log-probs, the optimizer, checkpoints and resume, the step log; the two trainers' shared loop)."""
