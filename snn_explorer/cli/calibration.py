"""``snn-explorer calibrate``: this machine's GPU measured into a hardware profile file."""
from __future__ import annotations

import re

import torch

from ..estimator.calibration.gpu import CudaRequiredError, calibrate_gpu, require_cuda
from .inputs import CliError, load_model_and_batch


def add_calibrate_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="measure this machine's GPU into a hardware profile file (.json)")
    p.add_argument("--device", choices=("cuda",), required=True,
                   help="cuda: this machine's GPU (GEMM/conv and elementwise rates at the model's shapes, launch "
                        "cost, NCCL collectives on every visible GPU)")
    p.add_argument("--model", help="module:factory or zoo:NAME whose shapes to time (it must carry an example "
                                   "input); default: square GEMMs, a 3x3 conv and activation-sized adds")
    p.add_argument("--out", help="the profile file to write (default: hardware-<gpu name>.json)")
    p.add_argument("--collectives-from", help="with one GPU: the built-in profile whose collectives to use "
                                              "(default: the one the GPU's name matches)")
    p.set_defaults(run=cmd_calibrate)


def cmd_calibrate(args) -> int:
    try:
        require_cuda()
    except CudaRequiredError as exc:
        raise CliError(str(exc)) from None
    model = example = None
    if args.model:
        model, _, _, carried = load_model_and_batch(args.model)
        if carried is None:
            raise CliError(f"--model {args.model!r} carries no example input to take its shapes from")
        model, example = model.to("cuda"), carried[0].to("cuda")
    out = args.out or "hardware-" + re.sub(r"[^A-Za-z0-9]+", "-", torch.cuda.get_device_name()).strip("-") + ".json"
    profile = calibrate_gpu(model, example, output=out, collectives_from=args.collectives_from)
    print(f"wrote {out}: {profile.name}: {profile.flops_per_s / 1e12:.1f} TFLOP/s fp32, "
          f"{(profile.half_flops_per_s or 0) / 1e12:.1f} bf16, {profile.bytes_per_s / 1e9:.0f} GB/s, "
          f"{profile.op_overhead_s * 1e6:.1f} us per kernel; {profile.topology}")
    print(f"use it: snn-explorer compare MODEL --hardware {out}   or   se.estimate(..., hardware={out!r})")
    return 0
