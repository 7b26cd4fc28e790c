"""Loading DeepSeek-V3 / Kimi-K2 targets from a local HF directory (config.json + safetensors,
sharded with ``model.safetensors.index.json`` or one ``model.safetensors``).

FP8 checkpoints (DeepSeek-V3's public format): a linear weight stored as float8_e4m3fn
[out, in] comes with ``<name>_scale_inv`` float32 [⌈out/128⌉, ⌈in/128⌉]; the real weight is
fp8 value × the scale of its 128×128 block (the name says "inv" because quantisation divided
by it). Dequantised at load here; no kernel consumes FP8 yet.
"""
from __future__ import annotations

import json
import logging
import pathlib
import time

import torch
import torch.nn.functional as F
from torch import nn

from modeling.deepseek import DeepseekConfig, DeepseekModel

log = logging.getLogger(__name__)
FP8_BLOCK = 128


def scale_grid(shape, block: tuple[int, int]) -> tuple[int, int]:
    """The block-scale grid of an FP8 weight of ``shape`` [out, in] in (bo, bi) blocks."""
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def dequantize_fp8(w: torch.Tensor, scale_inv: torch.Tensor, block: int | tuple[int, int] = FP8_BLOCK) -> torch.Tensor:
    """w [out, in] float8_e4m3fn, scale_inv [⌈out/bo⌉, ⌈in/bi⌉] for blocks (bo, bi) (an int:
    square) → float32 [out, in]. Raises ValueError if the scale grid does not cover w."""
    bo, bi = (block, block) if isinstance(block, int) else block
    o, i = w.shape
    want = scale_grid(w.shape, (bo, bi))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"scale grid {tuple(scale_inv.shape)} does not match weight {tuple(w.shape)} "
                         f"in {bo}x{bi} blocks (expected {want})")
    s = scale_inv.float().repeat_interleave(bo, 0)[:o].repeat_interleave(bi, 1)[:, :i]
    return w.float() * s


def quantize_fp8(w: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``dequantize_fp8`` (per-block amax / 448 scales): w [out, in] float →
    (float8_e4m3fn [out, in], scale_inv float32 [⌈out/block⌉, ⌈in/block⌉])."""
    o, i = w.shape
    bo, bi = -(-o // block), -(-i // block)
    pad = torch.zeros(bo * block, bi * block, dtype=torch.float32)
    pad[:o, :i] = w.float()
    amax = pad.view(bo, block, bi, block).abs().amax((1, 3)).clamp(min=1e-12)
    scale = amax / torch.finfo(torch.float8_e4m3fn).max
    q = (pad / scale.repeat_interleave(block, 0).repeat_interleave(block, 1))[:o, :i]
    return q.to(torch.float8_e4m3fn), scale


class FP8Linear(nn.Module):
    """A bias-free linear layer whose weight stays in the checkpoint's FP8 form (1 byte per
    weight + one float32 scale per block) and is dequantised to ``dtype`` on every forward
    (weight-only FP8: the memory of FP8, the arithmetic of ``dtype``). ``weight`` is that
    dequantised tensor, so code written for ``nn.Linear`` keeps working."""

    def __init__(self, w_fp8: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype):
        super().__init__()
        self.register_buffer("w_u8", w_fp8.view(torch.uint8))   # integer storage: .to(dtype) leaves it
        self.register_buffer("scale_inv", scale_inv.float())
        self.block, self.dtype = tuple(block), dtype
        self.out_features, self.in_features = w_fp8.shape

    @property
    def weight(self) -> torch.Tensor:
        return dequantize_fp8(self.w_u8.view(torch.float8_e4m3fn), self.scale_inv, self.block).to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def _apply(self, fn, recurse=True):
        """Moves between devices but never changes the stored dtypes (scales stay float32)."""
        dev = fn(torch.empty(0, device=self.scale_inv.device)).device
        self.w_u8, self.scale_inv = self.w_u8.to(dev), self.scale_inv.to(dev)
        return self


def take_fp8(w: torch.Tensor, scale_inv: torch.Tensor, rule: tuple[int, int], rank: int, world: int,
             block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """This rank's share of an FP8 weight and of its scale grid (``modeling.tp.take`` rules),
    or None when the share does not start and end on block boundaries (then dequantise first)."""
    from modeling.tp import take

    dim, _ = rule
    share = w.shape[dim] // world
    if share % block[dim] or w.shape[dim] % world:
        return None
    q = take(w.view(torch.uint8), rule, rank, world).view(torch.float8_e4m3fn)
    n = share // block[dim]
    return q, scale_inv.narrow(dim, rank * n, n).contiguous()


def _weight_map(path: pathlib.Path) -> dict[str, pathlib.Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        return {k: path / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    single = path / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{path} has neither model.safetensors.index.json nor model.safetensors")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {k: single for k in f.keys()}


def load_deepseek(path: str | pathlib.Path, device="cpu", dtype=torch.float32, rank: int = 0,
                  world: int = 1, keep_fp8: bool = False) -> DeepseekModel:
    """Build a ``DeepseekModel`` from an HF directory. Every parameter the config implies must
    be present with its exact shape; extra tensors (the MTP layers ≥ num_hidden_layers, FP8
    scales) are ignored. Progress (fraction of bytes, ETA) is logged every few seconds.
    With ``world`` > 1, only tensor-parallel rank ``rank``'s share is kept (``modeling.tp``;
    one full tensor at a time is read and dequantised), and the collectives are attached.
    keep_fp8: FP8 linear weights stay FP8 in memory (``FP8Linear``; a rank's share is cut
    along 128-blocks when its boundaries allow, else that tensor is dequantised at load).

    Raises KeyError naming a missing tensor (and its expected shape), ValueError naming a
    mis-shaped tensor with both shapes, an FP8 weight without its scale, or a router tensor with
    non-finite values."""
    from safetensors import safe_open

    path = pathlib.Path(path)
    cfg = DeepseekConfig.from_hf_dir(path)
    with torch.device("meta"):
        model = DeepseekModel(cfg)
    expected = model.state_dict()
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    if world > 1:
        from modeling.tp import shard_, shard_rule, take

        shard_(model, rank, world)
    where = _weight_map(path)
    missing = [n for n in expected if n not in where]
    if missing:
        raise KeyError(f"checkpoint {path} lacks tensor {missing[0]} (expected shape {list(expected[missing[0]].shape)})"
                       + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    total = sum(t.numel() for t in expected.values())
    done, t0, last = 0, time.monotonic(), time.monotonic()
    state, handles, kept = {}, {}, {}

    def read(name: str) -> torch.Tensor:
        file = where[name]
        try:
            f = handles.get(file) or handles.setdefault(file, safe_open(str(file), framework="pt"))
            return f.get_tensor(name)
        except Exception as e:  # noqa: BLE001 (safetensors' own error types): name the file and tensor
            raise ValueError(f"cannot read tensor {name} from {file}: {type(e).__name__}: {e}") from e

    try:
        for name, meta in expected.items():
            t = read(name)
            if t.dtype == torch.float8_e4m3fn:
                scale_name = name + "_scale_inv"
                if scale_name not in where:
                    raise ValueError(f"FP8 tensor {name} has no {scale_name}")
                scale = read(scale_name)
                if t.dim() != 2 or tuple(scale.shape) != scale_grid(t.shape, cfg.fp8_block):
                    raise ValueError(f"{scale_name} has shape {list(scale.shape)}; FP8 tensor {name} "
                                     f"{list(t.shape)} in {cfg.fp8_block[0]}x{cfg.fp8_block[1]} blocks needs "
                                     f"{list(scale_grid(t.shape, cfg.fp8_block)) if t.dim() == 2 else 'a 2-D weight'}")
                if tuple(t.shape) == tuple(meta.shape) and keep_fp8:
                    rule = shard_rule(name, cfg) if world > 1 else None
                    share = (t, scale) if rule is None else take_fp8(t, scale, rule, rank, world, cfg.fp8_block)
                    if share is not None:
                        kept[name] = share
                        done += t.numel()
                        continue
                t = dequantize_fp8(t, scale, cfg.fp8_block)
            elif not t.dtype.is_floating_point or t.dtype.itemsize == 1:
                raise ValueError(f"tensor {name} has dtype {t.dtype}; a weight must be a float dtype or "
                                 "float8_e4m3fn with block scales (…_scale_inv)")
            if tuple(t.shape) != tuple(meta.shape):
                raise ValueError(f"tensor {name} has shape {list(t.shape)} in the checkpoint, "
                                 f"the config implies {list(meta.shape)}")
            done += t.numel()
            rule = shard_rule(name, cfg) if world > 1 else None
            if rule is not None:
                t = take(t, rule, rank, world)
            router = name.endswith(("mlp.gate.weight", "e_score_correction_bias"))
            if router and not torch.isfinite(t).all():  # (the selection ranks NaN last; ±inf breaks group sums)
                raise ValueError(f"tensor {name} has {int((~torch.isfinite(t)).sum())} non-finite values; the "
                                 "router's weight and selection bias must be finite")
            state[name] = t.to(device=device, dtype=torch.float32 if router else dtype)
            now = time.monotonic()
            if now - last > 5:
                last, frac = now, done / total
                log.info("loading %s: %.0f%% of %d parameters, ETA %.0f s", path.name, 100 * frac, total,
                         (now - t0) * (1 - frac) / frac)
    finally:
        handles.clear()
    for name, (q, scale) in kept.items():  # swap the linear for its FP8 form, keeping TP hooks
        parent, attr = model.get_submodule(name.rsplit(".", 2)[0]), name.rsplit(".", 2)[1]
        old = getattr(parent, attr)
        new = FP8Linear(q.to(device), scale.to(device), cfg.fp8_block, dtype)
        new._forward_hooks = old._forward_hooks
        setattr(parent, attr, new)
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    unset = [n for n, t in model.state_dict().items() if t.is_meta]
    if unset:
        raise KeyError(f"checkpoint {path} left {unset[0]} unset ({len(unset)} tensors)")
    model.inv_freq = model.inv_freq.to(device)  # the rope's frequencies beside the weights (graph capture)
    log.info("loaded %s (%d parameters) in %.1f s", path.name, total, time.monotonic() - t0)
    return model.eval().requires_grad_(False)
