// Fused optimizer steps over one f32 parameter, its gradient and its state: exactly the
// arithmetic of crates/autograd/src/optim.rs, operation for operation. The explicitly
// rounded intrinsics (__fmul_rn, __fadd_rn, ...) are never contracted into FMAs, so every
// step rounds as the CPU's does; the hyper-parameters arrive already rounded to f32 by
// the host, as on the CPU.

// SGD (torch.optim.SGD, dampening 0): g += wd * p; with momentum, buf = g on the first
// step (momentum_mode 1) or buf = momentum * buf + g afterwards (mode 2), then g = buf;
// p -= lr * g. The gradient itself is not modified.
extern "C" __global__ void sgd_step_f32(float* p, const float* g, float* buf, u64 n, float lr, float momentum,
                                        float weight_decay, int momentum_mode) {
    GRID_STRIDE(i, n) {
        float gi = g[i];
        if (weight_decay != 0.0f) gi = __fadd_rn(gi, __fmul_rn(weight_decay, p[i]));
        if (momentum_mode == 1) {
            buf[i] = gi;
        } else if (momentum_mode == 2) {
            float b = __fadd_rn(__fmul_rn(momentum, buf[i]), gi);
            buf[i] = b;
            gi = b;
        }
        p[i] = __fsub_rn(p[i], __fmul_rn(lr, gi));
    }
}

// AdamW (torch.optim.AdamW): p *= decay; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g g;
// p -= step_size * m / (sqrt(v) / sqrt(bc2) + eps), with decay = 1 - lr wd and
// step_size = lr / bc1 computed on the host.
extern "C" __global__ void adamw_step_f32(float* p, const float* g, float* m, float* v, u64 n, float beta1,
                                          float beta2, float one_minus_beta1, float one_minus_beta2, float step_size,
                                          float bc2_sqrt, float eps, float decay) {
    GRID_STRIDE(i, n) {
        float gi = g[i];
        float pi = __fmul_rn(p[i], decay);
        float mi = __fadd_rn(__fmul_rn(beta1, m[i]), __fmul_rn(one_minus_beta1, gi));
        float vi = __fadd_rn(__fmul_rn(beta2, v[i]), __fmul_rn(__fmul_rn(one_minus_beta2, gi), gi));
        float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), bc2_sqrt), eps);
        pi = __fsub_rn(pi, __fdiv_rn(__fmul_rn(step_size, mi), denom));
        m[i] = mi;
        v[i] = vi;
        p[i] = pi;
    }
}
