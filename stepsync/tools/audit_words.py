"""What ``stepsync inspect`` says of the counts it finds disagreeing: each kind's explanation and fix, said once
however many checkpoints have it, and the numbers of each checkpoint apart."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

from ..core.frameworks import DEEPSPEED_LOOP


@dataclass(frozen=True)
class Mismatch:
    """One count in a checkpoint that disagrees with another: ``kind`` names what (its shared explanation and fix
    are :data:`EXPLAINED`, said once however many checkpoints have it), ``detail`` this checkpoint's numbers."""

    kind: str
    detail: str


TRAINER_FIX = ("resume with StepSyncCallback(policy='realign'), which adopts the engine's count (the run then ends at "
               "the engine's last update, with fewer updates than planned and the micro-batches after it untrained, "
               "both said), or with policy='sync', which keeps this drift and adds none; use policy='sync' from the "
               "start")
LOOP_FIX = "use stepsync.watch(accelerator, policy='sync') from the start, or accelerate >= 1.8.0"
EXPLAINED = {
    "named_by_the_trainer": "the folder is named by the Trainer's count, the tag by the engine's (DeepSpeed's issue "
                            f"#7405), and a resume inherits the drift: {TRAINER_FIX}",
    "loop_count": f"a resume inherits the drift: {LOOP_FIX}",
    "engine_loop_count": f"a resume inherits the drift: {DEEPSPEED_LOOP.remedy}",
    "open_window": "DeepSpeed saves neither their gradients nor its micro-step counter, so a resume loses them: resume "
                   "from a checkpoint saved with none in its open window, and save only where windows close from "
                   "the start: policy='sync' (StepSyncCallback, or stepsync.watch(accelerator, policy='sync')), or "
                   "accelerate >= 1.8.0",
    "renamed": "the folder was renamed or copied, and transformers' get_last_checkpoint picks folders by their name: "
               "give it back the name its trainer_state.json says",
    "record_and_tag": "the record was written for another engine state than the files hold: the folder's files were "
                      "replaced after the save",
}
# The same findings said of several checkpoints at once, their numbers in the table.
SEVERAL = {
    "named_by_the_trainer": "hold DeepSpeed tags other than the Trainer's count (the drift column)",
    "loop_count": "hold DeepSpeed steps other than your loop's count (the drift column)",
    "engine_loop_count": "hold DeepSpeed steps other than your loop's count (the drift column)",
    "open_window": "were saved with micro-batches in DeepSpeed's open window (the 'open window' column)",
    "renamed": "are named for other steps than their trainer_state.json says",
    "record_and_tag": "hold stepsync records of other engine steps than DeepSpeed's tags",
}
NAMES_ELSEWHERE = ("a script that places its resume by the folder's name lands there, not where the run stood: place "
                   "it with the record's position (stepsync_state.json: next_epoch, next_skip; "
                   "stepsync.resume_settings(..., loop='accelerate') gives the settings), and stepsync.watch says at "
                   "the first micro-batch where a resume lands and what it trains twice or skips")
ADJUSTED = ("trainer_state.json's global_step differs from the folder's number on purpose: stepsync wrote the step "
            "that lands the Trainer's resume on the next untrained micro-batch (the Trainer places a resume by "
            "global_step alone), and the folder, DeepSpeed's tag and stepsync's record keep the real count: resume "
            "with StepSyncCallback")


def listed(names: List[str], shown: int = 4, counted: bool = True) -> str:
    """``names`` for a sentence: all of them up to ``shown``, else the first few, the last and (``counted``) how
    many."""
    if len(names) <= shown:
        return ", ".join(names)
    return f"{', '.join(names[:shown - 1])} ... {names[-1]}" + (f", {len(names)} in all" if counted else "")
