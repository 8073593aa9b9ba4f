"""Where the time of one engine step goes: decode steps of N running requests, split into the engine's
phases (schedule, prepare, model forward, logits, sampling, bookkeeping) with wall clocks, the forward into the
decode stack's one C++ call and the rest, and, in as many more steps run under torch.profiler, the torch operators
by class (self CPU time). Writes a Markdown table.

    python benchmarks/profile_step.py --batch 1 --batch 32 --output docs/profile_decode.md
    python benchmarks/profile_step.py --batch 32 --temperature 0.8 --top-p 0.95   # sampled rows

Each configuration builds its own engine in this process, fills it with N requests of 128 prompt tokens
(ignore_eos), runs the prefills, then measures ``--steps`` decode steps. Medians over the steps. Each request's
prompt is one of the ``fixed`` workload's (ab_decode.fixed_prompts), so that every row reads KV of its own: until
stop 53 all N shared one prompt, whose blocks prefix caching then shared, and decode attention read a 32nd of the
KV a step reads in the benchmarks (docs/performance.md, stop 53).
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import time

import torch
from ab_decode import fixed_prompts
from torch.profiler import ProfilerActivity, profile

from inferd.config import EngineConfig
from inferd.engine import sampler as sampler_mod
from inferd.engine.llm_engine import LLMEngine
from inferd.engine.sampling_params import SamplingParams

# torch operators by what they do in the decoder (self CPU time).
CLASSES = {
    "linear GEMMs (oneDNN packed, mm, addmm)": ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm"),
    "attention (fused SDPA, bmm)": ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::bmm"),
    "KV gather/scatter (index, index_copy_, index_select)": ("aten::index", "aten::index_copy_",
                                                             "aten::index_select", "aten::embedding"),
    "softmax, masks": ("aten::_softmax", "aten::masked_fill_", "aten::softmax"),
    "copies, casts, cat": ("aten::copy_", "aten::cat", "aten::_to_copy", "aten::to", "aten::clone",
                           "aten::contiguous", "aten::empty", "aten::new_zeros", "aten::zeros"),
    "elementwise, norms, rope": ("aten::mul", "aten::add", "aten::rsqrt", "aten::pow", "aten::mean",
                                 "aten::silu", "aten::neg", "aten::sub", "aten::div"),
}


def _timed(store: list, fn):
    @functools.wraps(fn)
    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            store.append(time.perf_counter() - t0)
    return wrapper


class _TimedStack:
    """The model's decode stack (``inferd.model.llama.decode_stack``) with each ``run`` call timed: one C++ call
    for every layer of a step, whose GEMMs, attention and norms torch.profiler does not see."""

    def __init__(self, stack, store: list) -> None:
        self._stack = stack
        self.run = _timed(store, stack.run)


def measure(batch: int, steps: int, batch_invariant: bool, dtype: str, temperature: float = 0.0,
            top_p: float = 1.0) -> dict:
    engine = LLMEngine(EngineConfig(dtype=dtype, batch_invariant=batch_invariant, max_num_seqs=max(batch, 1)))
    engine.collapse_weights()  # as the server does after its first answer
    for i, prompt in enumerate(fixed_prompts(engine, batch)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=1_000, ignore_eos=True, temperature=temperature,
                                                           top_p=top_p, seed=i))
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.seqs.values()):
        engine.step()
    for _ in range(3):  # warm up the decode path
        engine.step()
    phases = collections.defaultdict(list)
    runner, model = engine.runner, engine.runner.model
    import inferd.engine.model_runner as mr
    orig = (engine.scheduler.schedule, runner.prepare, model.forward, model.compute_logits, mr.sample, model.stack,
            model.greedy_tokens)
    stack_s: list[float] = []
    totals = []
    try:
        engine.scheduler.schedule = _timed(phases["schedule"], orig[0])
        runner.prepare = _timed(phases["prepare inputs"], orig[1])
        model.forward = _timed(phases["model forward"], orig[2])
        model.compute_logits = _timed(phases["lm_head + logits"], orig[3])
        mr.sample = _timed(phases["sampling"], orig[4])
        # plain greedy steps take the lm_head's argmax without the logits (LlamaForCausalLM.greedy_tokens)
        model.greedy_tokens = _timed(phases["lm_head + argmax (greedy, no logits)"], orig[6])
        if model.stack is not None:
            model.stack = _TimedStack(model.stack, stack_s)
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            totals.append(time.perf_counter() - t0)
    finally:  # the profiled steps below run unwrapped: none of their (slower) times enter the phases
        (engine.scheduler.schedule, runner.prepare, model.forward, model.compute_logits, mr.sample,
         model.stack, model.greedy_tokens) = orig
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    step = statistics.median(totals)
    med = {k: statistics.median(v) for k, v in phases.items() if v}  # a phase the steps never entered: none
    # Each phase is its own median, so the rest is approximate (clamped at 0).
    med["bookkeeping (detokenize, stop checks, metrics)"] = max(0.0, step - sum(med.values()))
    fwd = med["model forward"]
    inside = {}
    if stack_s:
        inside["decode stack: every layer's GEMMs, attention, norms in one C++ call"] = statistics.median(stack_s)
    inside["the rest of the forward (embedding, rotary lookup, Python)"] = max(0.0, fwd - sum(inside.values()))
    ops = collections.Counter()
    for e in prof.key_averages():
        ops[e.key] += e.self_cpu_time_total / 1e6 / steps
    classes = {}
    seen = set()
    for name, keys in CLASSES.items():
        classes[name] = sum(ops[k] for k in keys)
        seen.update(keys)
    classes["other torch ops"] = sum(v for k, v in ops.items() if k not in seen and k.startswith("aten::"))
    return {"batch": batch, "step_s": step, "tok_s": batch / step, "phases": med, "inside_forward": inside,
            "step_ops": classes, "top_ops": ops.most_common(8)}


def to_markdown(results: list[dict], title: str) -> str:
    lines = [f"## {title}", ""]
    for r in results:
        lines += [f"### {r['batch']} running request(s): median step {r['step_s'] * 1e3:.1f} ms = "
                  f"{r['tok_s']:.1f} output tokens/s", "", "| phase | ms per step | share |", "|---|---:|---:|"]
        for k, v in r["phases"].items():
            lines.append(f"| {k} | {v * 1e3:.2f} | {v / r['step_s']:.0%} |")
        fwd = r["phases"]["model forward"]
        lines += ["", "Inside the model forward (wall clocks, the same steps):", "",
                  "| part | ms per step | share of forward |", "|---|---:|---:|"]
        for k, v in r["inside_forward"].items():
            lines.append(f"| {k} | {v * 1e3:.2f} | {v / fwd:.0%} |")
        lines += ["", "torch operators over whole steps (torch.profiler, self CPU time per step, in as many more steps "
                  "run under the profiler; the decode stack's C++ call is none of them):", "",
                  "| class | ms per step |", "|---|---:|"]
        for k, v in r["step_ops"].items():
            lines.append(f"| {k} | {v * 1e3:.2f} |")
        lines += ["", "Top operators: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in r["top_ops"]), ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, action="append", default=None)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--no-batch-invariant", dest="batch_invariant", action="store_false")
    ap.add_argument("--temperature", type=float, default=0.0, help="every request's (0: greedy)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    results = [measure(b, args.steps, args.batch_invariant, args.dtype, args.temperature, args.top_p)
               for b in (args.batch or [1, 32])]
    md = to_markdown(results, f"Decode step profile (dtype {args.dtype}, batch_invariant {args.batch_invariant}, "
                              f"temperature {args.temperature}, top_p {args.top_p}, {torch.get_num_threads()} threads)")
    print(md)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(md + "\n")


if __name__ == "__main__":
    main()
