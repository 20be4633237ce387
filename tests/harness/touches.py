"""Which of stepsync's functions call torch during a run: a TorchFunctionMode finds each call's nearest caller
outside torch. stepsync reads tensors in the bounded readers below only; docs/performance.md and docs/trainer.md name
the same ones (tests/unit/test_docs_facts.py holds them equal)."""
import os
import sys

PACKAGE = os.path.dirname(os.path.abspath(__import__("stepsync").__file__))
HARNESS = os.path.join(PACKAGE, "tools", "tiny_run.py")  # the tiny run itself, not the callback

# The readers: (the module under stepsync/, the qualified name's first part, or None for the whole module); with
# the weights' finder they share (a tensor's numel(), no read) and the collective under them.
READERS = (("engine/deepspeed.py", "FiniteWeights"), ("engine/deepspeed.py", "WeightFingerprint"),
           ("engine/deepspeed.py", "held_weights"), ("engine/deepspeed.py", "spread_across_ranks"),
           ("engine/deepspeed.py", "mean_across_ranks"), ("engine/tokens.py", None),
           ("trainer/losses.py", "UnappliedLosses"))
READER_CLASSES = ("FiniteWeights", "WeightFingerprint", "TokenWeights", "UnappliedLosses")  # as the docs name them


def reader_of(path: str, qualname: str):
    """The reader a touch at ``qualname`` in ``path`` belongs to, or None (a touch outside every reader)."""
    module = os.path.relpath(path, PACKAGE).replace(os.sep, "/")
    for where, name in READERS:
        if module == where and (name is None or qualname.split(".")[0] == name):
            return f"{where}:{name or '*'}"
    return None


def touching_mode():
    """A TorchFunctionMode whose ``touches`` lists (qualified name, path, where) of each torch call whose nearest
    caller outside torch is stepsync's own code."""
    from torch.overrides import TorchFunctionMode

    class Watch(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.touches = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            frame = sys._getframe(1)
            while frame is not None and f"{os.sep}torch{os.sep}" in frame.f_code.co_filename:
                frame = frame.f_back
            if frame is not None:
                path = frame.f_code.co_filename
                if path.startswith(PACKAGE) and path != HARNESS:
                    self.touches.append((frame.f_code.co_qualname, path, f"{getattr(func, '__name__', func)} from "
                                                                         f"{path}:{frame.f_lineno}"))
            return func(*args, **(kwargs or {}))

    return Watch()
