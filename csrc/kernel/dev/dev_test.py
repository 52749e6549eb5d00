"""Development check of the SM90 main backward kernel through the dev shim (ctypes), without the
extension: preprocess / postprocess done in torch here. Compares dq/dk/dv with a float64
reference and with the stock fused backward. Usage (GPU machine):
    python3 csrc/kernel/dev/dev_test.py LIB [--quick] [--bench] [--dims 128,64]
"""
import argparse
import ctypes
import math
import sys
import time

import torch
import torch.nn.functional as F

LOG2E = 1.4426950408889634


def round_up(s):
    return (s + 127) // 128 * 128


class Shim:
    def __init__(self, path):
        self.lib = ctypes.CDLL(path)
        f = self.lib.sm90_dev_bwd_main
        f.restype = ctypes.c_int
        f.argtypes = [ctypes.c_int] * 7 + [ctypes.c_float, ctypes.c_int, ctypes.c_int,
                                           ctypes.POINTER(ctypes.c_longlong), ctypes.POINTER(ctypes.c_longlong),
                                           ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
        self.f = f

    def backward(self, dout, q, k, v, out, lse, causal, scale, poison=True, dk=None, dv=None):
        """Returns dq, dk, dv (input dtype). lse: [B,H,Sq] natural log."""
        launch, post = self.prepare(dout, q, k, v, out, lse, causal, scale, poison, dk, dv)
        launch()
        return post()

    def prepare(self, dout, q, k, v, out, lse, causal, scale, poison=True, dk=None, dv=None):
        """Preprocess in torch; returns (launch: main kernel only, post: -> dq, dk, dv)."""
        B, Hq, Sq, D = q.shape
        Hkv, Sk = k.shape[1], k.shape[2]
        dev = q.device
        sqr, skr = round_up(Sq), round_up(Sk)
        dsum = torch.zeros(B, Hq, sqr, device=dev, dtype=torch.float32)
        dsum[:, :, :Sq] = (dout.float() * out.float()).sum(-1)
        lse2 = torch.full((B, Hq, sqr), float("inf"), device=dev, dtype=torch.float32)
        lse2[:, :, :Sq] = lse.float() * LOG2E
        dq_acc = torch.zeros(B, Hq, sqr, D, device=dev, dtype=torch.float32)
        gqa = Hq != Hkv
        if gqa:
            dk_acc = torch.zeros(B, Hkv, skr, D, device=dev, dtype=torch.float32)
            dv_acc = torch.zeros(B, Hkv, skr, D, device=dev, dtype=torch.float32)
            dk_o = dv_o = None
        else:
            dk_acc = dv_acc = None
            dk_o = dk if dk is not None else torch.empty_like(k)
            dv_o = dv if dv is not None else torch.empty_like(v)
            if poison:
                dk_o.fill_(float("nan"))
                dv_o.fill_(float("nan"))
        ptr = lambda t: 0 if t is None else t.data_ptr()
        ptrs = [ptr(q), ptr(k), ptr(v), ptr(out), ptr(dout), ptr(lse), ptr(dsum), ptr(lse2), ptr(dq_acc),
                ptr(dk_acc), ptr(dv_acc), 0, ptr(dk_o), ptr(dv_o)]
        st = lambda t: [0, 0, 0] if t is None else [t.stride(0), t.stride(1), t.stride(2)]
        strides = st(q) + st(k) + st(v) + st(out) + st(dout) + [0, 0, 0] + st(dk_o) + st(dv_o)
        P = (ctypes.c_longlong * 14)(*ptrs)
        S = (ctypes.c_longlong * 24)(*strides)
        err = ctypes.create_string_buffer(512)
        dtype = 0 if q.dtype == torch.float16 else 1
        stream = torch.cuda.current_stream().cuda_stream
        keep = (dsum, lse2, dq_acc, dk_acc, dv_acc)

        def launch():
            rc = self.f(dtype, B, Hq, Hkv, Sq, Sk, D, float(scale), int(causal), 0, P, S, ctypes.c_void_p(stream),
                        err, 512)
            if rc != 0:
                raise RuntimeError(f"shim rc={rc}: {err.value.decode()}")

        def post():
            _ = keep
            dq = (dq_acc[:, :, :Sq] * scale).to(q.dtype)
            if gqa:
                return dq, (dk_acc[:, :, :Sk] * scale).to(k.dtype), dv_acc[:, :, :Sk].to(v.dtype)
            return dq, dk_o, dv_o

        return launch, post


def causal_mask(sq, sk, device):
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril()


def reference(dout, q, k, v, causal, scale):
    """float64 autograd of explicit attention (top-left causal). Returns out, lse, dq, dk, dv."""
    qd, kd, vd = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    ke = kd.repeat_interleave(g, dim=1)
    ve = vd.repeat_interleave(g, dim=1)
    s = torch.matmul(qd, ke.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    o = torch.matmul(p, ve)
    dq, dk, dv = torch.autograd.grad(o, (qd, kd, vd), dout.double())
    return o.detach(), lse.detach(), dq, dk, dv


def stock(dout, q, k, v, causal, scale):
    """Stock fused SDPA backward on the same low-precision inputs."""
    g = q.shape[1] // k.shape[1]
    qs, ks, vs = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    ke = ks.repeat_interleave(g, dim=1)
    ve = vs.repeat_interleave(g, dim=1)
    sq, sk = q.shape[2], k.shape[2]
    if causal and sq != sk:
        o = F.scaled_dot_product_attention(qs, ke, ve, attn_mask=causal_mask(sq, sk, q.device), scale=scale)
    else:
        o = F.scaled_dot_product_attention(qs, ke, ve, is_causal=causal, scale=scale)
    return torch.autograd.grad(o, (qs, ks, vs), dout)


def rel_err(x, ref):
    x = x.double()
    return ((x - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()


def make_inputs(B, Hq, Hkv, Sq, Sk, D, dtype, layout="bhsd"):
    dev = "cuda"
    if layout == "packed":  # q,k,v views of one [B,S,3,H,D] tensor (needs Hq == Hkv, Sq == Sk)
        qkv = torch.randn(B, Sq, 3, Hq, D, device=dev, dtype=dtype)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    elif layout == "bshd":
        q = torch.randn(B, Sq, Hq, D, device=dev, dtype=dtype).transpose(1, 2)
        k = torch.randn(B, Sk, Hkv, D, device=dev, dtype=dtype).transpose(1, 2)
        v = torch.randn(B, Sk, Hkv, D, device=dev, dtype=dtype).transpose(1, 2)
    else:
        q = torch.randn(B, Hq, Sq, D, device=dev, dtype=dtype)
        k = torch.randn(B, Hkv, Sk, D, device=dev, dtype=dtype)
        v = torch.randn(B, Hkv, Sk, D, device=dev, dtype=dtype)
    dout = torch.randn(B, Hq, Sq, D, device=dev, dtype=dtype)
    return q, k, v, dout


def check(shim, B, Hq, Hkv, Sq, Sk, D, dtype, causal, layout="bhsd", results=None):
    torch.manual_seed(hash((B, Hq, Hkv, Sq, Sk, D, causal, layout)) % 2**31)
    q, k, v, dout = make_inputs(B, Hq, Hkv, Sq, Sk, D, dtype, layout)
    scale = 1.0 / math.sqrt(D)
    o64, lse, rdq, rdk, rdv = reference(dout, q, k, v, causal, scale)
    out = o64.to(dtype)
    dq, dk, dv = shim.backward(dout, q, k, v, out, lse.float(), causal, scale)
    torch.cuda.synchronize()
    errs = [rel_err(a, r) for a, r in zip((dq, dk, dv), (rdq, rdk, rdv))]
    nan = any(bool(torch.isnan(t).any()) for t in (dq, dk, dv))
    try:
        sdq, sdk, sdv = stock(dout, q, k, v, causal, scale)
        serrs = [rel_err(a, r) for a, r in zip((sdq, sdk, sdv), (rdq, rdk, rdv))]
    except Exception as e:  # noqa
        serrs = [float("nan")] * 3
    # max-abs errors relative to the reference's max (a reference of ~0, e.g. dq at Sq=Sk=1, is
    # judged against the stock error only)
    ok = (not nan) and all(e <= 2 * s + 2e-3 if not math.isnan(s) else e < 2e-2 for e, s in zip(errs, serrs))
    # repeatability (atomics change the summation order: allow rounding-level differences)
    dq2, dk2, dv2 = shim.backward(dout, q, k, v, out, lse.float(), causal, scale)
    rep = max(rel_err(a, b.double()) for a, b in zip((dq2, dk2, dv2), (dq, dk, dv)))
    ok = ok and rep < 1e-2
    tag = f"B={B} Hq={Hq} Hkv={Hkv} Sq={Sq} Sk={Sk} D={D} {str(dtype)[6:]} causal={int(causal)} {layout}"
    line = (f"{'OK  ' if ok else 'FAIL'} {tag:70s} ours dq/dk/dv {errs[0]:.2e} {errs[1]:.2e} {errs[2]:.2e}"
            f" | stock {serrs[0]:.2e} {serrs[1]:.2e} {serrs[2]:.2e} | rep {rep:.1e}{' NaN!' if nan else ''}")
    print(line, flush=True)
    if results is not None:
        results.append((ok, line))
    return ok


def bench(shim, dims, dtype=torch.bfloat16):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    print("\nbench (ms, TFLOP/s); bwd FLOPs = 2.5*4*b*h*s^2*d (/2 causal)")
    for D in dims:
        for causal in (False, True):
            for s in (1024, 4096, 8192):
                b, h = 16384 // s, 2048 // D
                q, k, v, dout = make_inputs(b, h, h, s, s, D, dtype)
                scale = 1 / math.sqrt(D)
                flops = 2.5 * 4 * b * h * s * s * D / (2 if causal else 1)
                qs, ks, vs = (t.clone().requires_grad_(True) for t in (q, k, v))
                res = {}
                for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
                    try:
                        with sdpa_kernel(be):
                            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
                        res[name] = lambda o=o: torch.autograd.grad(o, (qs, ks, vs), dout, retain_graph=True)
                    except Exception as e:
                        print("skip", name, e)
                out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
                o, lse = out[0], out[1]
                res["ours"] = lambda o=o, lse=lse: shim.backward(dout, q, k, v, o, lse, causal, scale, poison=False)
                res["ours_kernel"] = shim.prepare(dout, q, k, v, o, lse, causal, scale, poison=False)[0]
                times = {n: [] for n in res}
                for n, fn in res.items():
                    fn()
                torch.cuda.synchronize()
                for _ in range(10):
                    for n, fn in res.items():
                        st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        st.record(); fn(); en.record(); torch.cuda.synchronize()
                        times[n].append(st.elapsed_time(en))
                med = {n: sorted(t)[len(t) // 2] for n, t in times.items()}
                print(f"d={D} causal={int(causal)} s={s}: " + "  ".join(
                    f"{n} {m:.3f}ms {flops / m / 1e9:.0f}TF" for n, m in med.items()), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("lib")
    ap.add_argument("--dims", default="128")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--one", action="store_true", help="one small case per dim (for compute-sanitizer)")
    a = ap.parse_args()
    shim = Shim(a.lib)
    dims = [int(x) for x in a.dims.split(",")]
    if a.one:
        ok = True
        for D in dims:
            ok &= check(shim, 1, 2, 2, 300, 200, D, torch.bfloat16, True)
            ok &= check(shim, 1, 4, 2, 130, 260, D, torch.bfloat16, False)
        return 0 if ok else 1
    dtypes = [{"bf16": torch.bfloat16, "fp16": torch.float16}[x] for x in a.dtypes.split(",")]
    results = []
    for D in dims:
        for dtype in dtypes:
            for causal in (False, True):
                for (Sq, Sk) in ((128, 128), (1000, 1000), (17, 17), (1, 1), (1000, 17), (17, 1000), (4097, 4097),
                                 (128, 4097), (4097, 128)):
                    if a.quick and Sq * Sk > 1000 * 1000 and (Sq, Sk) != (4097, 4097):
                        continue
                    check(shim, 2, 4, 4, Sq, Sk, D, dtype, causal, results=results)
                check(shim, 2, 8, 2, 1000, 1000, D, dtype, causal, results=results)   # GQA
                check(shim, 1, 8, 1, 333, 777, D, dtype, causal, results=results)     # MQA
                check(shim, 2, 4, 4, 1000, 1000, D, dtype, causal, layout="packed", results=results)
                check(shim, 2, 4, 4, 600, 300, D, dtype, causal, layout="bshd", results=results)
            if dtype == dtypes[0]:
                check(shim, 7000, 10, 10, 17, 17, D, dtype, True, results=results)  # B*H = 70000
    nfail = sum(1 for ok, _ in results if not ok)
    print(f"\n{len(results) - nfail}/{len(results)} passed", flush=True)
    if a.bench:
        bench(shim, dims)
    return 1 if nfail else 0


if __name__ == "__main__":
    sys.exit(main())
