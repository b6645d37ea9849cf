"""The real vllm-flash-attn 2.6.2 Python interface, runnable on CPU.

`load_interface_dir()` downloads the wheel from PyPI once (`pip download --no-deps`, cached under
`.tools/wheels/`), checks its `vllm_flash_attn/*.py` against the wheel's RECORD hashes and
extracts them unchanged to `.tools/vllm-flash-attn-2.6.2/`. `install(monkeypatch)` puts that
package on sys.path with its CUDA extension, `vllm_flash_attn_2_cuda`, replaced by this module's
pure-torch `varlen_fwd`.

`varlen_fwd` is written from the wrapper's call (`_flash_attn_varlen_forward` passes 20
arguments by position) and the docstring of `flash_attn_varlen_func`; its checks mirror the
extension's own error messages (read with `strings` from the .so). Only the ops our attention
calls exist: a call into anything else fails with AttributeError.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import itertools
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import torch

from support.paths import REPO as ROOT

VERSION = "2.6.2"
WHEELS = ROOT / ".tools" / "wheels"
EXTRACTED = ROOT / ".tools" / f"vllm-flash-attn-{VERSION}"
EXTENSION = "vllm_flash_attn_2_cuda"


def _download_wheel() -> Path:
    found = sorted(WHEELS.glob(f"vllm_flash_attn-{VERSION}-*.whl"))
    if found:
        return found[0]
    # Only the Python files are used, so any one platform wheel will do: pin the cp311 one.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.11", "--platform", "manylinux1_x86_64",
           "-d", str(WHEELS), f"vllm-flash-attn=={VERSION}"]
    res = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
    found = sorted(WHEELS.glob(f"vllm_flash_attn-{VERSION}-*.whl"))
    if res.returncode != 0 or not found:
        raise RuntimeError(f"could not download vllm-flash-attn=={VERSION} from the package "
                           f"registry ({' '.join(cmd)}):\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
    return found[0]


def load_interface_dir() -> Path:
    """Directory holding the wheel's `vllm_flash_attn` package, byte-identical to the wheel."""
    if (EXTRACTED / "vllm_flash_attn" / "flash_attn_interface.py").exists():
        return EXTRACTED
    wheel = _download_wheel()
    with zipfile.ZipFile(wheel) as zf:
        record = next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
        hashes = {row[0]: row[1] for row in csv.reader(io.StringIO(zf.read(record).decode()))}
        tmp = EXTRACTED.with_suffix(".tmp")
        for name in zf.namelist():
            if name.startswith("vllm_flash_attn/") and name.endswith(".py"):
                data = zf.read(name)
                digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
                if hashes.get(name) != f"sha256={digest.decode()}":
                    raise RuntimeError(f"{wheel.name}: {name} does not match the wheel's RECORD")
                (tmp / name).parent.mkdir(parents=True, exist_ok=True)
                (tmp / name).write_bytes(data)
        tmp.rename(EXTRACTED)  # whole package or nothing, so a killed run leaves no half copy
    return EXTRACTED


def install(monkeypatch) -> types.ModuleType:
    """Make `import vllm_flash_attn` give the wheel's package over the pure-torch extension."""
    path = load_interface_dir()
    ext = types.ModuleType(EXTENSION)
    ext.calls = 0  # how many kernel calls ran, so a test can tell the flash path was taken

    def counted_varlen_fwd(*args):
        ext.calls += 1
        return varlen_fwd(*args)

    ext.varlen_fwd = counted_varlen_fwd
    monkeypatch.setitem(sys.modules, EXTENSION, ext)
    for name in ("vllm_flash_attn", "vllm_flash_attn.flash_attn_interface"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.syspath_prepend(str(path))
    import vllm_flash_attn

    assert vllm_flash_attn.__version__ == VERSION
    assert Path(vllm_flash_attn.__file__).parent == path / "vllm_flash_attn"
    # monkeypatch restores sys.modules entries it set; drop the imported package at teardown too.
    monkeypatch.setitem(sys.modules, "vllm_flash_attn", vllm_flash_attn)
    monkeypatch.setitem(sys.modules, "vllm_flash_attn.flash_attn_interface",
                        vllm_flash_attn.flash_attn_interface)
    return ext


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise RuntimeError(msg)  # the extension raises c10::Error, a RuntimeError


def _cu(name: str, t: torch.Tensor, batch: int) -> None:
    _check(t.dtype == torch.int32, f"{name} must have dtype int32")
    _check(t.is_contiguous(), f"{name} must be contiguous")
    _check(tuple(t.shape) == (batch + 1,), f"{name} must have shape (batch_size + 1)")


def varlen_fwd(q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, alibi_slopes,
               max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, zero_tensors, is_causal,
               window_size_left, window_size_right, softcap, return_softmax, gen):
    """mha_varlen_fwd, forward only. q [total_q, H, D]; k, v [total_k, KH, D], or paged
    [num_blocks, page_block_size, KH, D] with block_table [B, max_num_blocks_per_seq]. Run b
    has queries cu_seqlens_q[b]:cu_seqlens_q[b+1] and seqused_k[b] (else cu_seqlens_k[b+1] -
    cu_seqlens_k[b]) keys; causal is bottom-right aligned; query head h reads KV head
    h // (H / KH). Returns (out, q, k, v, out_padded, softmax_lse [H, total_q], S_dmask,
    rng_state)."""
    _check(q.dtype in (torch.float16, torch.bfloat16),
           "FlashAttention only support fp16 and bf16 data type")
    _check(k.dtype == q.dtype and v.dtype == q.dtype, "query and key must have the same dtype")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check(t.stride(-1) == 1, f"Input tensor {name} must have contiguous last dimension")
    _check(isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int),
           "max_seqlen_q and max_seqlen_k are ints")
    _check(p_dropout == 0.0 and alibi_slopes is None and softcap == 0.0 and not return_softmax
           and (window_size_left, window_size_right) == (-1, -1) and gen is None
           and zero_tensors is False, "only plain causal/non-causal attention is emulated")
    _check(q.dim() == 3, "q must have shape (total_q, num_heads, head_size_og)")
    total_q, h, d = q.shape
    batch = cu_seqlens_q.numel() - 1
    _check(batch > 0, "batch size must be positive")
    _cu("cu_seqlens_q", cu_seqlens_q, batch)
    _cu("cu_seqlens_k", cu_seqlens_k, batch)
    _check(d <= 256 and d % 8 == 0, "FlashAttention forward only supports head dimension at "
           "most 256 (and, here, a multiple of 8)")
    paged = block_table is not None
    if paged:
        _check(block_table.dtype == torch.int32, "block_table must have dtype torch.int32")
        _check(block_table.stride(-1) == 1, "block_table must have contiguous last dimension")
        _check(block_table.dim() == 2 and block_table.shape[0] == batch,
               "block_table must have shape (batch_size, max_num_blocks_per_seq)")
        _check(k.dim() == 4 and k.shape[-1] == d,
               "k must have shape (num_blocks, page_block_size, num_heads_k, head_size_og)")
        _check(k.shape[1] % 16 == 0, "Paged KV cache block size must be divisible by 16")
        kh = k.shape[2]
    else:
        _check(k.dim() == 3 and k.shape[-1] == d,
               "k must have shape (total_k, num_heads_k, head_size_og)")
        kh = k.shape[1]
    _check(v.shape == k.shape, "v must have the shape of k")
    _check(h % kh == 0, "Number of heads in key/value must divide number of heads in query")
    if seqused_k is not None:
        _check(seqused_k.dtype == torch.int32 and tuple(seqused_k.shape) == (batch,),
               "seqused_k_ must have shape (batch_size)")
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    _check(cq[0] == 0 and cq[-1] == total_q and all(a <= b for a, b in itertools.pairwise(cq)),
           "cu_seqlens_q must run from 0 to total_q")
    res = torch.zeros_like(q) if out is None else out
    _check(res.shape == q.shape, "out must have shape (sizes[0], sizes[1], head_size_og)")
    lse = torch.full((h, total_q), float("inf"), dtype=torch.float32)
    for b in range(batch):
        q0, q1 = cq[b], cq[b + 1]
        n_k = int(seqused_k[b]) if seqused_k is not None else ck[b + 1] - ck[b]
        _check(q1 - q0 <= max_seqlen_q and n_k <= max_seqlen_k, "a run exceeds max_seqlen")
        if paged:
            pages = block_table[b].tolist()
            page = k.shape[1]
            _check(n_k <= page * len(pages), "a run has more keys than its pages hold")
            keys = torch.cat([k[p] for p in pages[: -(-n_k // page)]])[:n_k] if n_k else k[0, :0]
            vals = torch.cat([v[p] for p in pages[: -(-n_k // page)]])[:n_k] if n_k else v[0, :0]
        else:
            keys, vals = k[ck[b]:ck[b] + n_k], v[ck[b]:ck[b] + n_k]
        keys = keys.float().repeat_interleave(h // kh, dim=1)
        vals = vals.float().repeat_interleave(h // kh, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), keys) * softmax_scale
        if is_causal:  # query i sees keys j <= i + n_k - n_q
            qpos = torch.arange(q1 - q0)[:, None] + (n_k - (q1 - q0))
            scores = scores.masked_fill(torch.arange(n_k)[None, :] > qpos, float("-inf"))
        lse[:, q0:q1] = torch.logsumexp(scores, -1)
        probs = torch.nan_to_num(scores.softmax(-1))  # a row with no key gives 0, as documented
        res[q0:q1] = torch.einsum("hqk,khd->qhd", probs, vals).to(q.dtype)
    empty = torch.empty(0)
    return res, q, k, v, res, lse, empty, torch.empty(2, dtype=torch.int64)
