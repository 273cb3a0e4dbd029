"""LoRA adapters on the base model: peft's files read and checked (adapter.py), held resident
beside each projection and applied per row of a mixed batch (stack.py)."""
