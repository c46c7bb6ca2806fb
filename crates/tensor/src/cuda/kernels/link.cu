// The simulated link on one GPU: a one-thread kernel that keeps its stream busy for a set
// number of nanoseconds of the GPU's global timer, so that a modelled transfer time really
// passes on the comm stream and its overlap with the compute stream's kernels shows in the
// CUDA-event trace.

__device__ __forceinline__ u64 global_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

extern "C" __global__ void spin_ns(u64 ns) {
    u64 start = global_ns();
    while (global_ns() - start < ns) {
    }
}
