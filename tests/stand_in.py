"""A stand-in engine for tests of what calls an engine: the contract's checks (rl/rollout/engine.py) over a
`_generate` of the test's own, with weights that are always loaded and memory that never moves."""

from rl.rollout.engine import Engine


class StandInEngine(Engine):
    def __init__(self, max_context_len: int = 4096):
        super().__init__(max_context_len)
        self.weights_loaded = True

    def _load_weights(self, weights) -> None:
        pass

    def _sleep(self, level: int) -> None:
        pass

    def _wake_up(self, tags: list[str]) -> None:
        pass
