// The CUDA execution model emulated on the CPU, so that the kernels of this directory run —
// slowly, but for real — on machines without a GPU (CI, laptops). `src/cuda/sim.rs` compiles
// every kernel source with the system C++ compiler, with this header and `EMBERS_HOST_SIM`
// defined, into one shared library, and launches kernels through it exactly as it would through
// the CUDA driver (same `void**` argument arrays, same grid and block shapes).
//
// What is emulated: grids and blocks (x, y, z), one fiber per CUDA thread, blocks run
// one after another; `__syncthreads`, `__syncwarp` and the warp shuffles / votes as barriers over
// the live threads of the block or warp; static and dynamic `__shared__` memory; atomics;
// the intrinsics the kernels use. Threads run in a fixed but scrambled order between barriers.
// What is reported instead of hanging: a barrier that not every live thread of the block or warp
// reaches (divergent `__syncthreads`), a shuffle that reads a lane that has exited.
// Not emulated: memory-model races (a fiber runs until it waits), timing, texture memory.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>
#include <ucontext.h>

#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

struct uint3 {
    unsigned x, y, z;
};
struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }

namespace embers_sim {

enum class Wait { None, Block, Warp, Done };

// Switching fibers. On x86-64 a hand-written switch that saves what the System V ABI has the
// callee keep (rbx, rbp, r12-r15, the SSE and x87 control words) and swaps stacks: ucontext's
// swapcontext also saves the signal mask, two system calls per switch, which made them most of
// an emulated launch's time. Elsewhere, ucontext.
#if defined(__x86_64__) && defined(__ELF__)
#define EMBERS_SIM_FAST_SWITCH 1
// Saves the caller's registers on its stack, stores its stack pointer in *save and resumes the
// fiber whose stack pointer is `next`.
extern "C" void embers_sim_switch(void** save, void* next);
asm(R"(
    .pushsection .text
    .p2align 4
    .globl embers_sim_switch
    .hidden embers_sim_switch
    .type embers_sim_switch, @function
embers_sim_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size embers_sim_switch, .-embers_sim_switch
    .popsection
)");
#endif

struct Fiber {
#ifdef EMBERS_SIM_FAST_SWITCH
    void* sp = nullptr;
#else
    ucontext_t context;
#endif
    uint3 tid;
    unsigned linear = 0;
    Wait wait = Wait::None;
    char* stack = nullptr;
};

constexpr size_t kStackBytes = 128 * 1024;

struct Launch {
    uint3 grid{1, 1, 1};
    uint3 block{1, 1, 1};
    uint3 block_idx{0, 0, 0};
    std::vector<unsigned char> dynamic_shared;
    std::vector<Fiber> fibers;
    std::vector<uint64_t> slots;  // one per thread: a warp shuffle's published value
    Fiber* current = nullptr;
#ifdef EMBERS_SIM_FAST_SWITCH
    void* scheduler = nullptr;
#else
    ucontext_t scheduler;
#endif
    std::function<void()> body;
    std::string error;
};

inline thread_local Launch* active = nullptr;
inline thread_local std::vector<std::unique_ptr<char[]>> stack_pool;
inline thread_local std::string last_error;

// Suspends the calling fiber and resumes the scheduler.
inline void to_scheduler(Launch* launch, Fiber* self) {
#ifdef EMBERS_SIM_FAST_SWITCH
    embers_sim_switch(&self->sp, launch->scheduler);
#else
    swapcontext(&self->context, &launch->scheduler);
#endif
}

// Resumes fiber `f` from the scheduler.
inline void to_fiber(Launch& launch, Fiber& f) {
    launch.current = &f;
#ifdef EMBERS_SIM_FAST_SWITCH
    embers_sim_switch(&launch.scheduler, f.sp);
#else
    swapcontext(&launch.scheduler, &f.context);
#endif
}

inline void trampoline() {
    Launch* launch = active;
    launch->body();
    launch->current->wait = Wait::Done;
#ifdef EMBERS_SIM_FAST_SWITCH
    // A finished fiber is never resumed.
    to_scheduler(launch, launch->current);
    __builtin_unreachable();
#endif
    // Returning resumes `uc_link`, the scheduler.
}

// A new fiber on `stack` that starts in `trampoline`.
inline void start_fiber(Launch& launch, Fiber& f) {
#ifdef EMBERS_SIM_FAST_SWITCH
    // The frame embers_sim_switch pops (from the lowest address): the control words, r15, r14,
    // r13, r12, rbx, rbp, the return address (trampoline), and a slot where trampoline's own
    // return address would be, so that it starts with the stack aligned as after a call.
    uintptr_t top = (reinterpret_cast<uintptr_t>(f.stack) + kStackBytes) & ~uintptr_t(15);
    uint64_t* frame = reinterpret_cast<uint64_t*>(top) - 9;
    uint32_t mxcsr;
    uint16_t fpcw;
    asm volatile("stmxcsr %0" : "=m"(mxcsr));
    asm volatile("fnstcw %0" : "=m"(fpcw));
    frame[0] = uint64_t(mxcsr) | (uint64_t(fpcw) << 32);
    for (int k = 1; k <= 6; ++k) frame[k] = 0;
    frame[7] = reinterpret_cast<uint64_t>(&trampoline);
    frame[8] = 0;
    f.sp = frame;
    (void)launch;
#else
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = f.stack;
    f.context.uc_stack.ss_size = kStackBytes;
    f.context.uc_link = &launch.scheduler;
    makecontext(&f.context, trampoline, 0);
#endif
}

// Suspends the calling thread until the scheduler releases the barrier it waits at.
inline void wait_at(Wait w) {
    Launch* launch = active;
    Fiber* self = launch->current;
    self->wait = w;
    to_scheduler(launch, self);
}

inline unsigned lane_id() { return active->current->linear % 32; }

// Runs one block to completion; false (with `launch.error` set) on a barrier deadlock.
inline bool run_block(Launch& launch) {
    const unsigned n = launch.block.x * launch.block.y * launch.block.z;
    while (stack_pool.size() < n) stack_pool.emplace_back(new char[kStackBytes]);
    launch.fibers.assign(n, Fiber{});
    launch.slots.assign(n, 0);
    for (unsigned i = 0; i < n; ++i) {
        Fiber& f = launch.fibers[i];
        f.linear = i;
        f.tid = {i % launch.block.x, (i / launch.block.x) % launch.block.y,
                 i / (launch.block.x * launch.block.y)};
        f.stack = stack_pool[i].get();
        start_fiber(launch, f);
    }
    // A scrambled but fixed order (odd stride through the threads), so that kernels relying on
    // thread order without a barrier are likelier to show it.
    const unsigned stride = n > 2 ? (n / 2) | 1u : 1u;
    for (;;) {
        for (unsigned k = 0, i = 0; k < n; ++k, i = (i + stride) % n) {
            Fiber& f = launch.fibers[i];
            if (f.wait != Wait::None) continue;
            to_fiber(launch, f);
        }
        bool live = false;
        bool released = false;
        for (unsigned base = 0; base < n; base += 32) {
            bool any = false, all_warp = true;
            for (unsigned i = base; i < n && i < base + 32; ++i) {
                Wait w = launch.fibers[i].wait;
                if (w == Wait::Done) continue;
                any = true;
                if (w != Wait::Warp) all_warp = false;
            }
            live = live || any;
            if (any && all_warp) {
                for (unsigned i = base; i < n && i < base + 32; ++i)
                    if (launch.fibers[i].wait == Wait::Warp) launch.fibers[i].wait = Wait::None;
                released = true;
            }
        }
        if (!live) return true;
        if (released) continue;
        bool all_block = true;
        for (Fiber& f : launch.fibers)
            if (f.wait != Wait::Done && f.wait != Wait::Block) all_block = false;
        if (all_block) {
            for (Fiber& f : launch.fibers)
                if (f.wait == Wait::Block) f.wait = Wait::None;
            continue;
        }
        launch.error = "barrier divergence in block (" + std::to_string(launch.block_idx.x) +
                       ", " + std::to_string(launch.block_idx.y) + ", " +
                       std::to_string(launch.block_idx.z) +
                       "): some live threads wait at __syncthreads, others at a warp barrier";
        return false;
    }
}

template <class... A, size_t... I>
void call_with(void (*kernel)(A...), void** args, std::index_sequence<I...>) {
    kernel(*static_cast<std::remove_cv_t<A>*>(args[I])...);
}

// dims: grid x, y, z, block x, y, z. Returns 0, or 1 with the message in `last_error`.
template <class... A>
int launch(void (*kernel)(A...), const unsigned* dims, unsigned shared_bytes, void** args) {
    Launch launch;
    launch.grid = {dims[0], dims[1], dims[2]};
    launch.block = {dims[3], dims[4], dims[5]};
    const unsigned threads = dims[3] * dims[4] * dims[5];
    if (threads == 0 || threads > 1024 || dims[0] == 0 || dims[1] == 0 || dims[2] == 0) {
        last_error = "invalid launch configuration: " + std::to_string(threads) +
                     " threads per block (1..=1024), grid " + std::to_string(dims[0]) + "x" +
                     std::to_string(dims[1]) + "x" + std::to_string(dims[2]);
        return 1;
    }
    launch.dynamic_shared.assign(shared_bytes, 0);
    launch.body = [&] { call_with(kernel, args, std::index_sequence_for<A...>{}); };
    Launch* outer = active;
    active = &launch;
    int status = 0;
    for (unsigned z = 0; z < dims[2] && status == 0; ++z)
        for (unsigned y = 0; y < dims[1] && status == 0; ++y)
            for (unsigned x = 0; x < dims[0] && status == 0; ++x) {
                launch.block_idx = {x, y, z};
                if (!run_block(launch)) {
                    last_error = launch.error;
                    status = 1;
                }
            }
    active = outer;
    return status;
}

// The kernel's parameters: count, and per parameter its size and whether it is a pointer.
template <class... A>
int signature(void (*)(A...), int* sizes, int* pointers, int capacity) {
    const int n = static_cast<int>(sizeof...(A));
    const int s[] = {static_cast<int>(sizeof(A))..., 0};
    const int p[] = {static_cast<int>(std::is_pointer_v<A>)..., 0};
    for (int i = 0; i < n && i < capacity; ++i) {
        sizes[i] = s[i];
        pointers[i] = p[i];
    }
    return n;
}

template <class T>
T shuffle(T value, int src_lane) {
    static_assert(sizeof(T) <= 8, "shuffles move at most 8 bytes");
    Launch* launch = active;
    Fiber* self = launch->current;
    const unsigned base = self->linear - self->linear % 32;
    uint64_t bits = 0;
    memcpy(&bits, &value, sizeof(T));
    launch->slots[self->linear] = bits;
    wait_at(Wait::Warp);
    T out = value;
    if (src_lane >= 0 && src_lane < 32) {
        const unsigned src = base + static_cast<unsigned>(src_lane);
        if (src < launch->fibers.size()) {
            if (launch->fibers[src].wait == Wait::Done) {
                // An exited lane: CUDA leaves the result undefined; make it loud.
                out = static_cast<T>(0xDEAD);
            } else {
                memcpy(&out, &launch->slots[src], sizeof(T));
            }
        }
    }
    wait_at(Wait::Warp);
    return out;
}

}  // namespace embers_sim

// ---- CUDA's vocabulary ----------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
// thread_local: tests launch the same kernel from several threads at once.
#define __shared__ static thread_local
#define __constant__ static
#define __launch_bounds__(...)
#define threadIdx (embers_sim::active->current->tid)
#define blockIdx (embers_sim::active->block_idx)
#define blockDim (embers_sim::active->block)
#define gridDim (embers_sim::active->grid)
#define warpSize 32
// `DYNAMIC_SHARED(float, buf)` declares the dynamic shared memory buffer of a launch.
#define DYNAMIC_SHARED(T, name) T* name = reinterpret_cast<T*>(embers_sim::active->dynamic_shared.data())

inline void __syncthreads() { embers_sim::wait_at(embers_sim::Wait::Block); }
inline void __syncwarp(unsigned = 0xffffffffu) { embers_sim::wait_at(embers_sim::Wait::Warp); }

template <class T>
T __shfl_sync(unsigned, T v, int src, int = 32) {
    return embers_sim::shuffle(v, src);
}
template <class T>
T __shfl_xor_sync(unsigned, T v, int mask, int = 32) {
    return embers_sim::shuffle(v, static_cast<int>(embers_sim::lane_id()) ^ mask);
}
template <class T>
T __shfl_down_sync(unsigned, T v, unsigned delta, int = 32) {
    int src = static_cast<int>(embers_sim::lane_id() + delta);
    T other = embers_sim::shuffle(v, src < 32 ? src : -1);
    return src < 32 ? other : v;
}
template <class T>
T __shfl_up_sync(unsigned, T v, unsigned delta, int = 32) {
    int src = static_cast<int>(embers_sim::lane_id()) - static_cast<int>(delta);
    T other = embers_sim::shuffle(v, src >= 0 ? src : -1);
    return src >= 0 ? other : v;
}
inline unsigned __ballot_sync(unsigned, int predicate) {
    unsigned out = 0;
    for (int lane = 0; lane < 32; ++lane) {
        // Every lane publishes once per round; lane `lane`'s value comes back to all.
        int p = embers_sim::shuffle(predicate ? 1 : 0, lane);
        if (p == 1) out |= 1u << lane;
    }
    return out;
}
// The lanes whose `value` equals this lane's, as a mask (sm_70+).
template <class T>
unsigned __match_any_sync(unsigned, T value) {
    unsigned out = 0;
    for (int lane = 0; lane < 32; ++lane) {
        if (embers_sim::shuffle(value, lane) == value) out |= 1u << lane;
    }
    return out;
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(unsigned x) { return __builtin_ffs(static_cast<int>(x)); }
inline int __any_sync(unsigned mask, int p) { return __ballot_sync(mask, p) != 0; }
inline int __all_sync(unsigned mask, int p) {
    return __ballot_sync(mask, p) == __ballot_sync(mask, 1);
}

inline float __uint_as_float(unsigned int u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
inline unsigned int __float_as_uint(float f) {
    unsigned int u;
    memcpy(&u, &f, 4);
    return u;
}
inline float __int_as_float(int i) {
    float f;
    memcpy(&f, &i, 4);
    return f;
}
inline int __float_as_int(float f) {
    int i;
    memcpy(&i, &f, 4);
    return i;
}
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }
template <class T>
T __ldg(const T* p) {
    return *p;
}

template <class T>
T embers_atomic_add(T* p, T v) {
    return std::atomic_ref<T>(*p).fetch_add(v);
}
inline float atomicAdd(float* p, float v) { return embers_atomic_add(p, v); }
inline double atomicAdd(double* p, double v) { return embers_atomic_add(p, v); }
inline int atomicAdd(int* p, int v) { return embers_atomic_add(p, v); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return embers_atomic_add(p, v); }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    return embers_atomic_add(p, v);
}
template <class T>
T embers_atomic_min(T* p, T v) {
    std::atomic_ref<T> a(*p);
    T old = a.load();
    while (v < old && !a.compare_exchange_weak(old, v)) {
    }
    return old;
}
template <class T>
T embers_atomic_max(T* p, T v) {
    std::atomic_ref<T> a(*p);
    T old = a.load();
    while (v > old && !a.compare_exchange_weak(old, v)) {
    }
    return old;
}
inline int atomicMin(int* p, int v) { return embers_atomic_min(p, v); }
inline long long atomicMin(long long* p, long long v) { return embers_atomic_min(p, v); }
inline unsigned long long atomicMin(unsigned long long* p, unsigned long long v) {
    return embers_atomic_min(p, v);
}
inline int atomicMax(int* p, int v) { return embers_atomic_max(p, v); }
inline long long atomicMax(long long* p, long long v) { return embers_atomic_max(p, v); }
inline unsigned long long atomicMax(unsigned long long* p, unsigned long long v) {
    return embers_atomic_max(p, v);
}
template <class T>
T embers_atomic_cas(T* p, T expected, T desired) {
    std::atomic_ref<T>(*p).compare_exchange_strong(expected, desired);
    return expected;
}
inline int atomicCAS(int* p, int e, int d) { return embers_atomic_cas(p, e, d); }
inline unsigned long long atomicCAS(unsigned long long* p, unsigned long long e,
                                    unsigned long long d) {
    return embers_atomic_cas(p, e, d);
}
inline int atomicExch(int* p, int v) { return std::atomic_ref<int>(*p).exchange(v); }
inline float atomicExch(float* p, float v) { return std::atomic_ref<float>(*p).exchange(v); }
inline unsigned long long atomicExch(unsigned long long* p, unsigned long long v) {
    return std::atomic_ref<unsigned long long>(*p).exchange(v);
}
