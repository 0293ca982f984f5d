"""Adam's step time on subnormal moments, flushed against not: why every spreeze process flushes them.

Units whose gradient stays zero (dead ReLUs) leave their Adam first moments decaying by beta1 per step through
the subnormal range (below about 1.2e-38 in float32), where an x86 core takes a slow path for each operation.
A freshly built learner has none, so the profile's isolated loop never meets them; a learner some minutes
into a run does. This times the optimizer steps of a checkpoint's own state (``--checkpoint``), or of the
critic's shapes with a share of its first moments made subnormal, with flushing off and on.

    python -m benchmarks.subnormals --checkpoint runs/<run>/checkpoints/latest.pt
    python -m benchmarks.subnormals --share 0.08 --hidden 256 --atoms 101
"""
from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import machine, markdown_table, results_dir, write_csv
from spreeze.proc import flush_denormals

TINY = torch.finfo(torch.float32).tiny


def synthetic_state(share: float, obs_act: int, hidden: int, atoms: int, seed: int = 0) -> list[dict]:
    """Adam states of a two-member critic: ``share`` of the first moments subnormal, their gradients zero."""
    g = torch.Generator().manual_seed(seed)
    states = []
    for shape in [(2, obs_act, hidden), (2, 1, hidden), (2, hidden, hidden), (2, 1, hidden), (2, hidden, atoms),
                  (2, 1, atoms)]:
        dead = torch.rand(shape, generator=g) < share
        exp_avg = torch.where(dead, torch.full(shape, 3e-40), torch.randn(shape, generator=g) * 1e-3)
        states.append({"step": torch.tensor(1000.0), "exp_avg": exp_avg,
                       "exp_avg_sq": torch.rand(shape, generator=g) * 1e-6, "dead": dead})
    return states


def checkpoint_states(path: str) -> dict[str, list[dict]]:
    """Each optimizer's per-parameter states in a spreeze checkpoint (gradients taken as zero where the first
    moment is already subnormal: a unit that gets none)."""
    algo = torch.load(path, map_location="cpu", weights_only=False)["algo"]
    out = {}
    for name, value in algo.items():
        if name.endswith("optimizer") and isinstance(value, dict) and value.get("state"):
            out[name] = [dict(s, dead=s["exp_avg"].abs() < TINY) for _, s in sorted(value["state"].items())]
    return out


def time_steps(states: list[dict], flush: bool, steps: int, repeats: int) -> float:
    """Best mean seconds per fused Adam step over ``repeats`` runs of ``steps``, each from the given state."""
    was = flush_denormals(flush)
    try:
        params = [torch.zeros_like(s["exp_avg"], requires_grad=True) for s in states]
        for p, s in zip(params, states):
            p.grad = torch.where(s["dead"], torch.zeros_like(p), torch.randn_like(p) * 1e-3)
        opt = torch.optim.Adam(params, lr=3e-4, fused=True)
        best = float("inf")
        for _ in range(repeats):
            opt.load_state_dict({"state": {i: {k: v.clone() for k, v in s.items() if k != "dead"}
                                           for i, s in enumerate(states)},
                                 "param_groups": opt.state_dict()["param_groups"]})
            start = time.perf_counter()
            for _ in range(steps):
                opt.step()
            best = min(best, (time.perf_counter() - start) / steps)
        return best
    finally:
        flush_denormals(was)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", help="a run's checkpoint (checkpoints/latest.pt); else synthetic states")
    parser.add_argument("--share", type=float, default=0.08, help="synthetic: share of subnormal first moments")
    parser.add_argument("--obs-act", type=int, default=28, help="synthetic: observation + action size")
    parser.add_argument("--hidden", type=int, default=256, help="synthetic: hidden layer width")
    parser.add_argument("--atoms", type=int, default=101, help="synthetic: critic outputs (C51 atoms)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--name", default="subnormals")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # a learner's; more would start pool threads that a later switch does not reach
    sets = (checkpoint_states(args.checkpoint) if args.checkpoint else
            {"critic_optimizer": synthetic_state(args.share, args.obs_act, args.hidden, args.atoms)})
    rows = []
    for name, states in sets.items():
        values = sum(s["exp_avg"].numel() for s in states)
        subnormal = sum(int(((s["exp_avg"] != 0) & (s["exp_avg"].abs() < TINY)).sum()) for s in states)
        off, on = (time_steps(states, flush, args.steps, args.repeats) for flush in (False, True))
        rows.append({"optimizer": name, "values": values, "subnormal_first_moments": subnormal,
                     "step_us_unflushed": round(off * 1e6), "step_us_flushed": round(on * 1e6),
                     "slowdown": round(off / on, 2)})
    print(markdown_table(rows))
    out = results_dir() / f"{args.name}.csv"
    cpu = machine(speed=False)["cpu_model"]
    write_csv(out, [dict(r, cpu=cpu, source=args.checkpoint or f"synthetic share {args.share}")
                    for r in rows])
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
