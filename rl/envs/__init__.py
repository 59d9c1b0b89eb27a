"""Built-in environments for `env.fn` (rl/env.py)."""
