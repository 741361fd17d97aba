"""PyTorch baselines for the conversion benchmark, written plainly as users write them today.

Runs on the GPU machine next to flowmoe_bench_convert: the naive row-wise FP8 -> column-wise FP8
path (dequantize -> transpose -> quantize, eager PyTorch, power-of-two 1x128 scales) and a plain
BF16 transpose, for DeepSeek-V3 shapes. Medians of CUDA-event timings after warm-up.
"""
import sys

import torch


def median_us(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    ts.sort()
    return ts[len(ts) // 2]


def quant_1x128(x2d):
    """[R, C] -> e4m3 codes [R, C] and power-of-two scales [R, C/128] (float32)."""
    r, c = x2d.shape
    xb = x2d.float().view(r, c // 128, 128)
    amax = xb.abs().amax(-1, keepdim=True)
    s = torch.exp2(torch.ceil(torch.log2(amax / 448.0)).clamp(min=-127))
    return (xb / s).to(torch.float8_e4m3fn).view(r, c), s.view(r, c // 128)


def main():
    m = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
    k = int(sys.argv[2]) if len(sys.argv) > 2 else 7168
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    q, s = quant_1x128(x)

    def naive():
        xd = (q.float().view(m, k // 128, 128) * s.view(m, k // 128, 1)).to(torch.bfloat16).view(m, k)
        return quant_1x128(xd.t().contiguous())

    def transpose():
        return x.t().contiguous()

    n = m * k
    t_q = median_us(lambda: quant_1x128(x))
    t_naive = median_us(naive)
    t_tr = median_us(transpose)
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}: M={m} K={k}")
    print(f"  torch eager quantize 1x128 (BF16->FP8)       {t_q:9.1f} us  {3.0 * n / t_q / 1e3:7.0f} GB/s (3 B/elem)")
    print(f"  torch eager naive DQ->T->Q (row->col FP8)    {t_naive:9.1f} us  {2.0 * n / t_naive / 1e3:7.0f} GB/s-equivalent (2 B/elem)")
    print(f"  torch x.t().contiguous() BF16                {t_tr:9.1f} us  {4.0 * n / t_tr / 1e3:7.0f} GB/s (4 B/elem)")


if __name__ == "__main__":
    main()
