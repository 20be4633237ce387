"""Write and execute notebooks/walkthrough.ipynb (run with the drifting stack: .stacks/drifting/bin/python)."""
import os
import tempfile

import nbformat as nbf
from nbclient import NotebookClient

md = nbf.v4.new_markdown_cell
code = nbf.v4.new_code_cell
cells = [
md("""# stepsync walkthrough

With DeepSpeed and `gradient_accumulation_steps=G > 1`, the Trainer decides where an accumulation window ends,
and DeepSpeed decides it again with its own micro-step counter. That counter never restarts at an epoch.
When an epoch's micro-batch count N is not a multiple of G, the two disagree. The Trainer's `state.global_step`
(logging, saving, `max_steps`, checkpoint names) then drifts from `engine.global_steps` (the real updates and the
learning-rate schedule). The smallest case: G=2, N=3, 2 epochs, transformers 5.24 with accelerate 1.7. The Trainer
counts 4 updates, DeepSpeed makes 3.

This notebook runs on CPU: a tiny GPT-2 built from a config, the real Trainer, the real DeepSpeed engine.
The test suite runs it on the drifting stack (`bash scripts/test.sh`)."""),
md("## 1. The forecast, before any training"),
code("""from stepsync.core.forecast import RunPlan, forecast
from stepsync.core.versions import Stack, behaviour_of

stack = Stack.installed()
predicted = forecast(RunPlan(micro_batches_per_epoch=3, gradient_accumulation_steps=2, num_train_epochs=2),
                     behaviour_of(stack))
print(stack)
print(predicted.verdict())
[(row.epoch, row.trainer_steps, row.engine_steps) for row in predicted.epochs]"""),
md("## 2. A real run that drifts (stepsync only watches: policy `warn`)"),
code("""import logging, tempfile
from transformers import TrainerCallback
from stepsync import StepSyncCallback
from stepsync.tools.tiny_run import run_tiny


class Counters(TrainerCallback):
    \"\"\"Both counters after every micro-batch, read from the Trainer's state and its DeepSpeed engine.\"\"\"

    def __init__(self):
        self.trainer_steps, self.engine_steps, self.trainer = [], [], None

    def watch(self, trainer):
        self.trainer = trainer

    def _read(self, state):
        self.trainer_steps.append(state.global_step)
        self.engine_steps.append(self.trainer.model_wrapped.global_steps)

    def on_substep_end(self, args, state, control, **kwargs):
        self._read(state)

    def on_step_end(self, args, state, control, **kwargs):
        self._read(state)


def counted_run(policy):
    counters, sync = Counters(), StepSyncCallback(policy, console=False)
    run_tiny(tempfile.mkdtemp(), samples=3, gas=2, epochs=2, log_level="error", logging_strategy="no",
             callbacks=[counters, sync], on_trainer=counters.watch)
    return counters, sync.report


logging.getLogger("stepsync").setLevel(logging.ERROR)  # the report below says it all
watched, report = counted_run("warn")
print(f"Trainer {report.trainer_steps}, engine {report.engine_steps}, drift {report.drift:+d}")
for event in report.events:
    print(event.message())
assert [(r.trainer_steps, r.engine_steps) for r in report.epochs] == [(r.trainer_steps, r.engine_steps) for r in predicted.epochs]"""),
md("## 3. The same run with `policy=\"sync\"`: DeepSpeed updates where the Trainer counts"),
code("""synced, synced_report = counted_run("sync")
print(f"Trainer {synced.trainer_steps[-1]}, engine {synced.engine_steps[-1]}, drift {synced_report.drift:+d}")
assert synced.trainer_steps == synced.engine_steps and synced_report.drift == 0"""),
md("## 4. Both counters against micro-batches"),
code("""import matplotlib.pyplot as plt

fig, axes = plt.subplots(1, 2, figsize=(10, 4), dpi=100, sharey=True)
for ax, (title, result) in zip(axes, [("without a remedy (policy 'warn')", watched), ("policy 'sync'", synced)]):
    steps = range(1, len(result.trainer_steps) + 1)
    ax.step(steps, result.trainer_steps, where="post", linewidth=2.5, label="Trainer global_step")
    ax.step(steps, result.engine_steps, where="post", linewidth=2.5, linestyle="--",
            label="engine global_steps")
    ax.set_title(title, fontsize=13)
    ax.set_xlabel("micro-batch", fontsize=12)
    ax.set_xticks(list(steps))
    ax.grid(alpha=0.3)
axes[0].set_ylabel("optimizer updates counted", fontsize=12)
axes[0].legend(fontsize=11, loc="upper left")
plt.tight_layout()
plt.show()"""),
]
nb = nbf.v4.new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": tempfile.mkdtemp()}}).execute()
for cell in nb.cells:  # keep stored outputs small: drop build noise on stderr
    cell.get("metadata", {}).pop("execution", None)
    if "outputs" in cell:
        cell["outputs"] = [o for o in cell["outputs"] if o.get("name") != "stderr"]
nbf.write(nb, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "notebooks", "walkthrough.ipynb"))
