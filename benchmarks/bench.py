"""stepsync's overhead, measured on real runs: run with a stack's python, e.g.

    bash scripts/stack.sh drifting && .stacks/drifting/bin/python benchmarks/bench.py

Prints (a) the median and p99 cost of each hook stepsync runs per micro-batch, timed inside real
Trainer + DeepSpeed runs on CPU, net of a no-op callback timed at the same place in paired runs; (b) the share
of the training loop spent in all of stepsync's hooks; (b') training throughput with stepsync / without, from
interleaved runs (A B A B ...) and the median of the per-pair ratios; (c) the wall time of `stepsync check` and of
`import stepsync`, and whether that import pulled in torch or deepspeed; (d) the forecast of 10^6
micro-batches per epoch over 100 epochs; (e) the resume check; (f) `stepsync.watch(engine)` in loops that drive
DeepSpeed's engine themselves: each hook's median and the share of the loop's time spent in them; (g) reading each
token's weight at the logits: its cost per micro-batch against a forward and backward, and what it takes of a run;
(h) the ranks' weights compared; (i) `stepsync.watch(model, optimizer=...)` on an FSDP2 loop: each hook's median and
the share of the loop's time.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

POLICIES = ("warn", "raise", "sync", "realign", "drop_last")
PER_MICRO_BATCH = ("on_substep_end", "on_step_end", "on_log")
ONCE_OR_PER_EPOCH = ("on_train_begin", "on_epoch_begin", "on_epoch_end", "on_train_end")
GOALS = {"hook_median_us": 2.0, "throughput_ratio": 0.995, "check_s": 0.3, "forecast_ms": 10.0, "resume_check_ms": 50.0}


class TimedCallback:
    """Wraps the hooks of a StepSyncCallback instance with a nanosecond timer (about 0.1 us of its own)."""

    def __init__(self, callback, hooks=PER_MICRO_BATCH):
        self.samples = {name: [] for name in hooks}
        for name in hooks:
            setattr(callback, name, self._timed(getattr(callback, name), self.samples[name]))

    @staticmethod
    def _timed(hook, into):
        clock = time.perf_counter_ns

        def timed(*args, **kwargs):
            start = clock()
            result = hook(*args, **kwargs)
            into.append(clock() - start)
            return result

        return timed


def timer_overhead_ns() -> float:
    """What the wrapper itself costs around an empty function, subtracted from every sample."""
    class Empty:
        def on_step_end(self, *args, **kwargs):
            return None

    empty = Empty()
    timed = TimedCallback(empty, ("on_step_end",))
    for _ in range(20000):
        empty.on_step_end(None, None, None)
    return statistics.median(timed.samples["on_step_end"])


def loop_clock():
    """A callback timing the training loop only, on_train_begin to on_train_end (no model or engine building)."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter_ns()

        def on_train_end(self, args, state, control, **kwargs):
            self.nanoseconds = time.perf_counter_ns() - self.start

    return Clock()


def right_after_the_flow_callback(callback):
    """Put ``callback`` where StepSyncCallback puts itself: right after the Trainer's DefaultFlowCallback."""

    def place(trainer):
        others = [cb for cb in trainer.callback_handler.callbacks if cb is not callback]
        at = next(i for i, cb in enumerate(others) if type(cb).__name__ == "DefaultFlowCallback") + 1
        trainer.callback_handler.callbacks = [*others[:at], callback, *others[at:]]

    return place


def measure_hooks(samples: int, gas: int, runs: int, logging_steps: int):
    """Per policy and hook: (calls, median us, p99 us, median us of a no-op TrainerCallback).

    The no-op runs in its own run, paired with each stepsync run, at the place stepsync takes in the Trainer's
    list (right after DefaultFlowCallback): a callback's cost depends on what ran just before it.
    """
    from transformers import TrainerCallback

    from stepsync import StepSyncCallback
    from stepsync.tools.tiny_run import run_tiny

    overhead = timer_overhead_ns()
    rows, shares = [], {}
    for policy in POLICIES:  # one run of each first, not timed: the process's first runs are slower
        run_tiny(tempfile.mkdtemp(), samples=samples, gas=gas, epochs=1, log_level="error", disable_tqdm=True,
                 callbacks=[StepSyncCallback(policy, console=False)], logging_steps=logging_steps)
    for policy in POLICIES:
        collected = {name: [] for name in PER_MICRO_BATCH}
        baseline = {name: [] for name in PER_MICRO_BATCH}
        shares[policy] = []
        # raise would stop at the first divergence: give it an aligned run (N a multiple of G)
        n = samples - samples % gas if policy == "raise" else samples
        for _ in range(runs):
            noop = TrainerCallback()  # what any callback costs the Trainer: the same call, doing nothing
            timed_noop = TimedCallback(noop)
            run_tiny(tempfile.mkdtemp(), samples=n, gas=gas, epochs=1, callbacks=[noop], log_level="error",
                     disable_tqdm=True, logging_steps=logging_steps, on_trainer=right_after_the_flow_callback(noop))
            callback = StepSyncCallback(policy, console=False)
            timed = TimedCallback(callback, PER_MICRO_BATCH + ONCE_OR_PER_EPOCH)
            clock = loop_clock()
            result = run_tiny(tempfile.mkdtemp(), samples=n, gas=gas, epochs=1, callbacks=[clock, callback],
                              log_level="error", disable_tqdm=True, logging_steps=logging_steps)
            assert result.error is None, result.error
            # Every nanosecond stepsync's hooks took in this run, over the run's training loop.
            spent = sum(sum(values) for values in timed.samples.values())
            shares[policy].append(spent / clock.nanoseconds)
            for into, source in ((collected, timed), (baseline, timed_noop)):
                for name, values in source.samples.items():
                    if name in into:
                        into[name] += [max(v - overhead, 0) for v in values]
        for name, values in collected.items():
            if values:
                rows.append((policy, name, len(values), statistics.median(values) / 1000,
                             statistics.quantiles(values, n=100)[98] / 1000, statistics.median(baseline[name]) / 1000))
    return overhead, rows, {policy: statistics.median(values) for policy, values in shares.items()}


def measure_warm_hooks(calls: int):
    """The same hooks called back to back on a finished real run's engine and state (warm caches)."""
    import logging

    from transformers import TrainerCallback

    from stepsync import StepSyncCallback
    from stepsync.tools.tiny_run import run_tiny

    logging.getLogger("stepsync").setLevel(logging.CRITICAL)  # hooks called past the run's end say so
    clock = time.perf_counter_ns
    rows = []
    for policy in POLICIES:
        callback = StepSyncCallback(policy, console=False)
        result = run_tiny(tempfile.mkdtemp(), samples=8, gas=4, epochs=1, callbacks=[callback], log_level="error")
        trainer = result.trainer
        kwargs = dict(model=trainer.model, processing_class=None, optimizer=trainer.optimizer,
                      lr_scheduler=trainer.lr_scheduler, train_dataloader=None, eval_dataloader=None)
        args, state, control = trainer.args, trainer.state, trainer.control
        noop = TrainerCallback()
        for name in ("on_substep_end", "on_step_end"):
            medians = []
            for target in (getattr(callback, name), getattr(noop, name)):
                samples = []
                for _ in range(calls):
                    start = clock()
                    target(args, state, control, **kwargs)
                    samples.append(clock() - start)
                medians.append(statistics.median(samples) / 1000)
            rows.append((policy, name, medians[0], medians[1]))
    return rows


def measure_throughput(samples: int, gas: int, pairs: int):
    from stepsync import StepSyncCallback
    from stepsync.tools.tiny_run import run_tiny

    def one(policy):
        clock = loop_clock()
        n = samples - samples % gas if policy == "raise" else samples
        callbacks = [clock, StepSyncCallback(policy, console=False)] if policy else [clock]
        result = run_tiny(tempfile.mkdtemp(), samples=n, gas=gas, epochs=1, callbacks=callbacks, log_level="error",
                          disable_tqdm=True, logging_steps=10**9)
        assert result.error is None, result.error
        return n / (clock.nanoseconds / 1e9)  # micro-batches per second (batch 1, one epoch)

    one(None)  # warm caches and the compiled op
    rows = []
    for policy in POLICIES:
        ratios = []
        for _ in range(pairs):
            without = one(None)
            with_stepsync = one(policy)
            ratios.append(with_stepsync / without)
        rows.append((policy, statistics.median(ratios), min(ratios), max(ratios)))
    return rows


def measure_cli(repeats: int):
    python = sys.executable
    env = dict(os.environ)
    check = [python, "-m", "stepsync", "check", "--samples", "1000", "--gas", "4", "--epochs", "3", "--json"]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(check, env=env, capture_output=True, check=False)
        times.append(time.perf_counter() - start)
    code = ("import time, sys; t = time.perf_counter(); import stepsync; d = time.perf_counter() - t; "
            "print(d, 'torch' in sys.modules, 'deepspeed' in sys.modules)")
    imports = []
    for _ in range(repeats):
        out = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True).stdout.split()
        imports.append((float(out[0]), out[1] == "True", out[2] == "True"))
    start = time.perf_counter()
    subprocess.run([python, "-c", "pass"], capture_output=True)
    bare = time.perf_counter() - start
    return statistics.median(times), bare, statistics.median(i[0] for i in imports), any(i[1] for i in imports), \
        any(i[2] for i in imports)


def measure_forecast(repeats: int):
    from stepsync.core.forecast import RunPlan, forecast
    from stepsync.core.versions import Stack, behaviour_of

    behaviour = behaviour_of(Stack("5.24.0", "1.7.0", "0.19.8"))
    plan = RunPlan(10**6 + 1, 8, 100)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = forecast(plan, behaviour)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000, max(times) * 1000, result


def measure_resume_check(repeats: int):
    """The check a resume on another layout makes once at the start: the record read from its checkpoint, then the
    Trainer's resume arithmetic on the new layout (median ms)."""
    import json

    from stepsync.core.record import ResumeRecord, load_record
    from stepsync.core.relayout import Layout
    from stepsync.core.versions import PlannedSteps

    folder = tempfile.mkdtemp()
    record = ResumeRecord("warn", 6000, 6000, 6000, 2, 0, world_size=8, per_device_batch=4,
                          gradient_accumulation_steps=16, examples=10**7, zero_stage=2)
    with open(os.path.join(folder, "trainer_state.json"), "w") as handle:
        json.dump({"global_step": 6000, "stateful_callbacks": {"StepSyncCallback": {
            "args": {}, "attributes": {"saved_record": record.to_dict()}}}}, handle)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        loaded = load_record(folder)
        shift = loaded.resume_on(Layout(6, 4, 16, 10**7, 2), 6000, PlannedSteps.CEIL, 3)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000, shift


ENGINE_HOOKS = ("_before_backward", "_before_step", "_after_step")


@contextlib.contextmanager
def timed_on_the_class(cls, hooks):
    """Each of ``cls``'s methods ``hooks`` timed (its samples yielded by name), set on the class before a watch binds
    them as it starts; given back after."""
    samples = {name: [] for name in hooks}
    originals = {name: getattr(cls, name) for name in hooks}
    for name in hooks:
        setattr(cls, name, TimedCallback._timed(originals[name], samples[name]))
    try:
        yield samples
    finally:
        for name, original in originals.items():
            setattr(cls, name, original)


def watch_figures(samples, micro_batches: int, loop_ns: int):
    """(each hook's median us, the us per micro-batch spent in all of them, the share of the loop they leave), the
    timer's own cost taken from every sample as in (a)."""
    overhead = timer_overhead_ns()
    samples = {name: [max(value - overhead, 0) for value in taken] for name, taken in samples.items()}
    hooks_ns = sum(sum(taken) for taken in samples.values())
    medians = {name: statistics.median(taken) / 1000 if taken else 0.0 for name, taken in samples.items()}
    return medians, hooks_ns / micro_batches / 1000, 1 - hooks_ns / loop_ns


def measure_engine_watch(micro_batches: int, gas: int):
    """(f): DeepSpeed-Chat's loop (backward() and step() on every micro-batch, the engine's G) and open-instruct's
    learner (``gas`` backward() calls per step(), the config's G=1), ZeRO-2, the tiny GPT-2 the Trainer's runs train,
    on CPU, one run per policy: each hook's median (us) and the share of the loop's wall time spent in all of them
    (its start and the forecast included)."""
    import logging

    import deepspeed
    import torch

    import stepsync
    from stepsync.deepspeed.watch import EngineWatch
    from stepsync.tools.tiny_run import TinyDataset, tiny_model

    logging.getLogger("stepsync").setLevel(logging.CRITICAL)
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    data = TinyDataset(micro_batches)
    batches = [{key: value.unsqueeze(0) for key, value in data[i].items()} for i in range(micro_batches)]
    rows = []
    runs = [("chat", "warn"), ("chat", "raise"), ("chat", "sync"), ("learner", "warn"), ("learner", "sync"),
            ("learner", "sync, K untold")]
    for shape, policy in runs:
        model = tiny_model()
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas if shape == "chat" else 1,
                  "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True}
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3),
                                          config=config)
        with timed_on_the_class(EngineWatch, ENGINE_HOOKS) as samples:
            told = {"gradient_accumulation_steps": gas} if (shape, policy) == ("learner", "sync") else {}
            watch = stepsync.watch(engine, policy.split(",")[0], dataloader=batches, num_epochs=1, console=False,
                                   **told)
            start = time.perf_counter_ns()
            for i, batch in enumerate(batches):
                engine.backward(engine(**batch).loss)
                if shape == "chat" or (i + 1) % gas == 0:
                    engine.step()
            loop_ns = time.perf_counter_ns() - start
            watch.close()
        engine.destroy()
        rows.append((shape, policy, *watch_figures(samples, micro_batches, loop_ns)))
    return rows


SHARDED_HOOKS = ("_forward_hook", "_backward", "_steer", "_before_step", "_after_step", "_before_zero_grad")


def measure_sharded_watch(micro_batches: int, gas: int):
    """(i): a torch-native loop whose model is sharded with FSDP2 (``fully_shard`` on each block of the tiny GPT-2 and
    on its root; one rank, gloo, CPU), the gradient sync on at each window's last micro-batch, one run per policy:
    each hook's median (us) and the share of the loop's wall time spent in all of them."""
    import logging

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import stepsync
    from stepsync.fsdp.watch import ShardedWatch
    from stepsync.tools.tiny_run import TinyDataset, cpu_distributed_env, tiny_model

    logging.getLogger("stepsync").setLevel(logging.CRITICAL)
    if not dist.is_initialized():
        cpu_distributed_env()
        dist.init_process_group("gloo", rank=0, world_size=1)
    data = TinyDataset(micro_batches)
    batches = [{key: value.unsqueeze(0) for key, value in data[i].items()} for i in range(micro_batches)]
    rows = []
    for policy in ("warn", "raise", "sync"):
        with timed_on_the_class(ShardedWatch, SHARDED_HOOKS) as samples:
            model = tiny_model()
            for block in model.transformer.h:
                fully_shard(block)
            fully_shard(model)
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
            watch = stepsync.watch(model, optimizer=optimizer, policy=policy, dataloader=batches, num_epochs=1,
                                   gradient_accumulation_steps=gas, console=False)
            start = time.perf_counter_ns()
            for i, batch in enumerate(batches):
                last = (i + 1) % gas == 0
                model.set_requires_gradient_sync(last)
                model(**batch).loss.backward()
                if last:
                    optimizer.step()
                    optimizer.zero_grad()
            loop_ns = time.perf_counter_ns() - start
            watch.close()
        rows.append((policy, *watch_figures(samples, micro_batches, loop_ns)))
    return rows


def measure_token_reading(repeats: int):
    """(g): ``stepsync.engine.tokens.sequence_weights`` on the gradient at the logits, per micro-batch (median us),
    against the micro-batch's own forward and backward: the tiny GPT-2 the runs above train (8 positions, 64
    tokens), and a bigger shape (4 sequences of 512 positions, 32000 tokens: logits and a cross-entropy alone)."""
    import torch

    from stepsync.engine.tokens import sequence_weights
    from stepsync.tools.tiny_run import TinyDataset, tiny_model

    def median_us(work) -> float:
        work()
        samples = []
        for _ in range(repeats):
            start = time.perf_counter_ns()
            work()
            samples.append(time.perf_counter_ns() - start)
        return statistics.median(samples) / 1000

    rows = []
    model = tiny_model()
    batch = {key: value.unsqueeze(0) for key, value in TinyDataset(1)[0].items()}
    seen = {}

    def step():
        out = model(**batch)
        out.logits.register_hook(lambda grad: seen.update(grad=grad, logits=out.logits.detach()))
        out.loss.backward()

    rows.append(("tiny GPT-2, 1 x 8 x 64", median_us(step),
                 median_us(lambda: sequence_weights(seen["logits"], seen["grad"], 0))))
    torch.manual_seed(0)
    logits = torch.randn(4, 512, 32000, requires_grad=True)
    labels = torch.randint(0, 32000, (4, 512))
    labels[:, 300:] = -100

    def cross_entropy():
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 32000), labels.reshape(-1), ignore_index=-100)
        logits.grad = None
        loss.backward()

    cross_entropy()
    grad = logits.grad.clone()
    rows.append(("4 x 512 x 32000, cross-entropy alone", median_us(cross_entropy),
                 median_us(lambda: sequence_weights(logits.detach(), grad, 0))))
    return rows


def measure_fingerprints(repeats: int):
    """(h): ``stepsync.engine.deepspeed.WeightFingerprint`` (the sum and the norm of a rank's weights, read at train
    begin, epoch ends and checkpoints on several ranks), its local part, median us per comparison: the tiny
    GPT-2's parameters, and 10^7 weights in one flat buffer in fp32 and in bf16 as DeepSpeed keeps them. The
    all-reduce of its four numbers that follows is one small collective per comparison."""
    from types import SimpleNamespace

    import torch

    from stepsync.engine.deepspeed import WeightFingerprint
    from stepsync.tools.tiny_run import tiny_model

    def median_us(fingerprint) -> float:
        fingerprint.ranks_agree()
        samples = []
        for _ in range(repeats):
            start = time.perf_counter_ns()
            fingerprint.ranks_agree()
            samples.append(time.perf_counter_ns() - start)
        return statistics.median(samples) / 1000

    rows = [("tiny GPT-2 parameters", median_us(WeightFingerprint(SimpleNamespace(module=tiny_model()))))]
    for dtype in (torch.float32, torch.bfloat16):
        flat = torch.randn(10 ** 7).to(dtype)
        engine = SimpleNamespace(optimizer=SimpleNamespace(bit16_groups_flat=[flat]))
        name = str(dtype).split(".")[-1]
        rows.append((f"10^7 weights, one flat {name} buffer", median_us(WeightFingerprint(engine))))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=400, help="micro-batches per run (default 400)")
    parser.add_argument("--gas", type=int, default=4)
    parser.add_argument("--runs", type=int, default=2, help="runs per policy for the hook timings")
    parser.add_argument("--pairs", type=int, default=9, help="interleaved A/B pairs per policy")
    parser.add_argument("--logging-steps", type=int, default=10,
                        help="the Trainer's logging_steps in the timed runs (default 10; the Trainer's own is 500)")
    parser.add_argument("--skip-throughput", action="store_true")
    args = parser.parse_args(argv)

    from stepsync.core.versions import Stack
    from stepsync.tools.tiny_run import cpu_distributed_env

    cpu_distributed_env()
    print(f"stack: {Stack.installed()}; python {sys.version.split()[0]}; {os.cpu_count()} CPU(s); "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
    failures = []

    overhead, hooks, shares = measure_hooks(args.samples, args.gas, args.runs, args.logging_steps)
    print(f"\n(a) hook cost per call, real runs, N={args.samples}, G={args.gas}, logging_steps={args.logging_steps} "
          f"(timer's own {overhead / 1000:.2f} us subtracted)")
    print("    'no-op' is an empty TrainerCallback timed where stepsync sits in the Trainer's callback list, in")
    print("    runs paired with stepsync's: the price of any callback call there;")
    print("    'net' = median - no-op, what stepsync's work adds; the goal, <= 2 us per micro-batch, applies to it for")
    print("    warn, raise, realign and drop_last (sync's goal is its throughput share, (b))")
    print(f"{'policy':<10} {'hook':<15} {'calls':>6} {'median us':>10} {'p99 us':>8} {'no-op us':>9} {'net us':>7}")
    micro_batches = {policy: sum(calls for p, name, calls, *_ in hooks if p == policy and name != "on_log")
                     for policy in POLICIES}
    for policy, name, calls, median, p99, noop in hooks:
        net = median - noop
        # each hook's goal is its cost spread over the micro-batches: on_substep_end runs at the micro-batches that
        # end no update, on_step_end once per update, on_log once per logging_steps updates
        per_micro_batch = net * calls / micro_batches[policy]
        shown = f"  ({per_micro_batch:.2f} per micro-batch)"
        print(f"{policy:<10} {name:<15} {calls:>6} {median:>10.2f} {p99:>8.2f} {noop:>9.2f} {net:>7.2f}{shown}")
        if policy != "sync" and per_micro_batch > GOALS["hook_median_us"]:  # sync's goal is its throughput share
            failures.append(f"{policy} {name} net {per_micro_batch:.2f} us per micro-batch > "
                            f"{GOALS['hook_median_us']} us")

    print("\n(b) throughput with stepsync / without, from the same runs: 1 - (time in all of stepsync's hooks, "
          "train_begin to train_end) / (training-loop time); the goal (>= 0.995) applies to it")
    for policy, share in shares.items():
        print(f"{policy:<10} {1 - share:.4f}")
        if 1 - share < GOALS["throughput_ratio"]:
            failures.append(f"{policy} in-run throughput ratio {1 - share:.4f} < {GOALS['throughput_ratio']}")

    warm = measure_warm_hooks(20000)
    print("\n(a') the same hooks called 20000 times back to back (warm caches), median us, and a no-op's")
    for policy, name, median, noop in warm:
        print(f"{policy:<10} {name:<15} {median:>6.2f}  no-op {noop:.2f}  net {median - noop:.2f}")

    if not args.skip_throughput:
        rows = measure_throughput(args.samples, args.gas, args.pairs)
        print(f"\n(b') throughput with stepsync / without, {args.pairs} interleaved pairs (A B A B ...) of "
              f"{args.samples} micro-batches: median, min, max of the per-pair ratios. On a machine whose runs "
              "vary by more than the effect, this bounds the overhead only loosely; (b) measures it")
        for policy, median, low, high in rows:
            print(f"{policy:<10} {median:.4f}  ({low:.4f} .. {high:.4f})")

    check, bare, imported, torch_in, deepspeed_in = measure_cli(5)
    print(f"\n(c) `stepsync check` wall time {check:.3f} s (a bare `python -c pass`: {bare:.3f} s); "
          f"`import stepsync` {imported * 1000:.1f} ms; pulled in torch: {torch_in}, deepspeed: {deepspeed_in}")
    if check > GOALS["check_s"]:
        failures.append(f"stepsync check {check:.3f} s > {GOALS['check_s']} s")
    if torch_in or deepspeed_in:
        failures.append("import stepsync pulled in torch or deepspeed")

    median_ms, worst_ms, result = measure_forecast(50)
    print(f"\n(d) forecast of 10^6 + 1 micro-batches/epoch x 100 epochs: median {median_ms:.3f} ms, worst "
          f"{worst_ms:.3f} ms (Trainer {result.trainer_steps}, engine {result.engine_steps})")
    if median_ms > GOALS["forecast_ms"]:
        failures.append(f"forecast {median_ms:.3f} ms > {GOALS['forecast_ms']} ms")

    resume_ms, shift = measure_resume_check(50)
    print(f"\n(e) the resume-on-another-layout check (record read, the Trainer's arithmetic, once per run): median "
          f"{resume_ms:.3f} ms; 8 ranks -> 6 ranks skips {sum(shift.skipped.values())} and repeats "
          f"{sum(shift.repeated.values())} sample(s)")
    if resume_ms > GOALS["resume_check_ms"]:
        failures.append(f"resume check {resume_ms:.3f} ms > {GOALS['resume_check_ms']} ms")

    whole = args.samples - args.samples % args.gas
    engine_rows = measure_engine_watch(whole, args.gas)
    print(f"\n(f) stepsync.watch(engine), ZeRO-2, {whole} micro-batches, G={args.gas}: "
          "'chat' steps after every micro-batch (DeepSpeed-Chat), 'learner' after G backward() calls (open-instruct; "
          "under sync the watch is given gradient_accumulation_steps=G; 'K untold': it is not, and one backward() "
          "of a zero loss closes each window on ZeRO 1-2, counted in the share, the price the start's note names)")
    print(f"{'loop':<8} {'policy':<14} " + " ".join(f"{name.strip('_'):>15}" for name in ENGINE_HOOKS)
          + f" {'us/micro-batch':>15} {'share':>7}")
    for shape, policy, medians, per_micro_batch, share in engine_rows:
        print(f"{shape:<8} {policy:<14} " + " ".join(f"{medians[name]:>15.2f}" for name in ENGINE_HOOKS)
              + f" {per_micro_batch:>15.2f} {share:>7.4f}")
        if policy.endswith("untold"):  # the price of a choice the user is told how to avoid, shown, not a goal
            continue
        if shape == "chat" and policy != "sync" and per_micro_batch > GOALS["hook_median_us"]:
            failures.append(f"engine watch {shape} {policy} {per_micro_batch:.2f} us per micro-batch > "
                            f"{GOALS['hook_median_us']} us")
        if share < GOALS["throughput_ratio"]:
            failures.append(f"engine watch {shape} {policy} share {share:.4f} < {GOALS['throughput_ratio']}")

    sharded_rows = measure_sharded_watch(whole, args.gas)
    print(f"\n(i) stepsync.watch(model, optimizer=...) on an FSDP2 loop (fully_shard, one rank, gloo), {whole} "
          f"micro-batches, G={args.gas}, the sync on at each window's last: each hook's median (us), the watch's us "
          "per micro-batch and the share of the loop's time")
    print(f"{'policy':<7} " + " ".join(f"{name.strip('_'):>14}" for name in SHARDED_HOOKS)
          + f" {'us/micro-batch':>15} {'share':>7}")
    for policy, medians, per_micro_batch, share in sharded_rows:
        print(f"{policy:<7} " + " ".join(f"{medians[name]:>14.2f}" for name in SHARDED_HOOKS)
              + f" {per_micro_batch:>15.2f} {share:>7.4f}")
        if share < GOALS["throughput_ratio"]:
            failures.append(f"FSDP2 watch {policy} share {share:.4f} < {GOALS['throughput_ratio']}")

    from stepsync.engine.tokens import WINDOWS_READ

    reads = WINDOWS_READ * args.gas
    print(f"\n(g) each token's weight read at the logits (stepsync.engine.tokens), per micro-batch read, median us; "
          f"read until a window tells the rules apart, at most {WINDOWS_READ} windows ({reads} micro-batches at G="
          f"{args.gas}), then unhooked. 'share': of a {args.samples}-micro-batch run that reads the most (the goal "
          "applies to the model's full step); 'runs from': the run length whose share reaches the goal")
    print(f"{'shape':<38} {'forward+backward us':>20} {'read us':>9} {'read/step':>10} {'share':>7} {'runs from':>10}")
    for shape, step_us, read_us in measure_token_reading(50):
        share = 1 - min(reads, args.samples) * read_us / (args.samples * step_us)
        enough = math.ceil(reads * read_us / step_us / (1 - GOALS["throughput_ratio"]))
        print(f"{shape:<38} {step_us:>20.1f} {read_us:>9.1f} {read_us / step_us:>10.3f} {share:>7.4f} {enough:>10}")
        if shape.startswith("tiny") and share < GOALS["throughput_ratio"]:
            failures.append(f"token reading on {shape}: share {share:.4f} < {GOALS['throughput_ratio']}")

    comparisons = 2  # train begin and the epoch's end: a one-epoch run of args.samples micro-batches
    tiny_step_us = measure_token_reading(20)[0][1]
    print(f"\n(h) the ranks' weights compared (stepsync.engine.deepspeed.WeightFingerprint), its local part per "
          f"comparison, median us; 'share': of a one-epoch {args.samples}-micro-batch run of the tiny GPT-2, which "
          f"compares {comparisons} times (train begin and the epoch's end; and at each checkpoint)")
    for shape, call_us in measure_fingerprints(20):
        line = f"{shape:<40} {call_us:>12.1f} us"
        if shape.startswith("tiny"):
            share = 1 - comparisons * call_us / (args.samples * tiny_step_us)
            line += f"   share {share:.5f}"
            if share < GOALS["throughput_ratio"]:
                failures.append(f"rank comparison share {share:.4f} < {GOALS['throughput_ratio']}")
        print(line)

    print("\ngoals: " + ("all met" if not failures else "MISSED: " + "; ".join(failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
