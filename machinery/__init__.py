"""The stages' machinery, none of the method: models.py (loading, the embedded model, the samplers: transformers,
an OpenAI-compatible server, vLLM) and training.py (the trainers' shared settings and loop, FSDP2, checkpoints)."""
