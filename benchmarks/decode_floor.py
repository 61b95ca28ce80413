"""Where a decode step goes beyond its matmuls: one-token steps of a run folder's model (eager, or its compiled step)
against two floors timed in the same process, interleaved: its linears alone (F.linear on each Linear's weight and
the head's, the floor int8_decode.py reports) and the decode plan's packed matmuls alone (one x @ W_t per pack, the
matmuls a step really runs). step - packed is what the step spends on everything else: attention over the cache,
its writes, norms, RoPE, residuals, the per-op and per-call overhead.

    .venv/bin/python benchmarks/decode_floor.py --run RUN [--mode eager|compiled] [--layers N] [--profile [--kernels]]

--layers N keeps the first N blocks (a faster compile; the per-layer costs are the same); --profile prints torch's
profiler table of 10 steps (--kernels: the compiled graph's own kernels recorded too, a fresh compile). CPU clock,
one torch thread by default (a shared machine: other tenants drop out); per-step times are medians of --rounds.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from bench import interleaved, parser, start


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--run", required=True, help="a run folder (e.g. SmolLM2-135M-Instruct from archlab convert)")
    ap.add_argument("--mode", choices=("eager", "compiled"), default="eager")
    ap.add_argument("--layers", type=int, default=None, help="keep the first N blocks")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--steps", type=int, default=40, help="decode steps timed per round")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", action="store_true", help="torch profiler table of 10 steps")
    ap.add_argument("--kernels", action="store_true", help="with --profile --mode compiled: inductor's kernels too")
    args = ap.parse_args()
    start(args, clock="cpu")
    if args.kernels:
        import torch._inductor.config as inductor_config
        inductor_config.cpp.enable_kernel_profile = True

    import archlab
    from archlab.generation.stepper import Stepper
    from archlab.runs.model_folder import load_run

    model = load_run(args.run)[0].eval()
    if args.layers is not None:
        kept = archlab.TransformerLM(model.config.with_overrides({"n_layers": args.layers})).eval()
        kept.load_state_dict({k: v for k, v in model.state_dict().items() if k in kept.state_dict()})
        model = kept
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, args.prompt))
    mask = torch.ones_like(ids, dtype=torch.bool)
    compiled = args.mode == "compiled"

    def stepper():                                   # prefilled, a few steps in: the graph and the packs warm
        run = Stepper(model, ids, mask, args.steps + 8, compile=compiled)
        token = run.prefill().argmax(-1)
        for _ in range(4):
            run.step(token)
        return run, token

    with torch.inference_mode():
        t0 = time.perf_counter()
        stepper()
        print(f"{model.config.n_layers} layers, {args.mode}: first steps {time.perf_counter() - t0:.1f} s (wall, "
              "compiling included)", flush=True)
        weights = [m.weight for m in model.modules() if type(m) is torch.nn.Linear] + [model.lm_head.matrix]
        packs = [p for slot in model.decode_plan().packs.values() for p in slot.values() if hasattr(p, "w_t")]
        rows = {n: torch.randn(1, n) for n in {w.shape[1] for w in weights} | {p.w_t.shape[0] for p in packs}}

        def steps():
            run, token = stepper()
            t0 = time.process_time()
            for _ in range(args.steps):
                run.step(token)
            return time.process_time() - t0

        def repeat(fn):
            def timed():
                t0 = time.process_time()
                for _ in range(args.steps):
                    fn()
                return time.process_time() - t0
            return timed

        def linears():
            for w in weights:
                F.linear(rows[w.shape[1]], w)

        def packed():
            for p in packs:
                torch.mm(rows[p.w_t.shape[0]], p.w_t)

        seconds: dict[str, list[float]] = {"step": [], "linears": [], "packed": []}
        fns = {"step": steps, "linears": repeat(linears), "packed": repeat(packed)}
        for name, fn in fns.items():                  # interleaved() times the calls; each returns its own CPU time
            fns[name] = (lambda fn=fn, name=name: seconds[name].append(fn() / args.steps))
        interleaved(fns, args.rounds, clock=time.process_time)
        for name in seconds:
            seconds[name] = seconds[name][1:]         # the warm-up call
        ms = {name: 1e3 * statistics.median(ts) for name, ts in seconds.items()}
        over = [s - p for s, p in zip(seconds["step"], seconds["packed"])]
        floor = statistics.median(s / f for s, f in zip(seconds["step"], seconds["linears"]))
        print(f"ms a step (median of {args.rounds}): {args.mode} step {ms['step']:.2f} | linears alone (F.linear, "
              f"{len(weights)}) {ms['linears']:.2f} | packed matmuls alone ({len(packs)}) {ms['packed']:.2f}",
              flush=True)
        print(f"  step / linears {floor:.3f} | step - packed matmuls {1e3 * statistics.median(over):.2f} ms "
              f"(rounds {1e3 * min(over):.2f}-{1e3 * max(over):.2f})", flush=True)
        if args.profile:
            from torch.profiler import profile

            run, token = stepper()
            with profile() as prof:
                for _ in range(10):
                    run.step(token)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=80))


if __name__ == "__main__":
    main()
