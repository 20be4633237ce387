"""One phase of an accelerate loop written as transformers' run_*_no_trainer.py examples write it, under torchrun (or
as one process): accumulate(), a completed_steps counter, save_state("step_N") after every update, and on resume
their arithmetic (``resume_step = N * G`` micro-batches, whole epochs first, then ``skip_first_batches``). Each rank
writes OUT/NAME-R.json with (epoch, completed_steps before it, [sample]) for every micro-batch it trained.

    python -m torch.distributed.run --nproc_per_node W tests/entry/accelerate_resume_runs.py OUT NAME SAMPLES
        G EPOCHS [CHECKPOINT]
"""
import json
import os
import sys
import warnings


def main(out, name, samples, gas, epochs, checkpoint=None):
    import torch
    from accelerate import Accelerator

    from harness.runs import forget_deepspeed

    warnings.filterwarnings("ignore")
    forget_deepspeed()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=gas)
    model = torch.nn.Linear(samples, 1, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.DataLoader(torch.eye(samples), batch_size=1, shuffle=False)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    starting_epoch, resume_step, completed_steps = 0, None, 0
    if checkpoint:  # run_clm_no_trainer.py's resume, verbatim in substance
        accelerator.load_state(checkpoint)
        resume_step = int(os.path.basename(checkpoint).replace("step_", "")) * gas
        starting_epoch = resume_step // len(data)
        completed_steps = resume_step // gas
        resume_step -= starting_epoch * len(data)
    trained = []
    for epoch in range(starting_epoch, epochs):
        active = data
        if checkpoint and epoch == starting_epoch and resume_step is not None:
            active = accelerator.skip_first_batches(data, resume_step)
        for batch in active:
            trained.append([epoch, completed_steps, [int(batch.argmax())]])
            with accelerator.accumulate(model):
                accelerator.backward(model(batch).sum())
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                completed_steps += 1
                accelerator.save_state(os.path.join(out, name, f"step_{completed_steps}"))
    with open(os.path.join(out, f"{name}-{accelerator.process_index}.json"), "w") as handle:
        json.dump({"trained": trained, "error": None, "world": accelerator.num_processes}, handle)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), *(sys.argv[6:7]))
    from harness.runs import end_process_group

    end_process_group()
