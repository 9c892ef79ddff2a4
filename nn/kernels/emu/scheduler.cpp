// cuda_emu.h's scheduler: a block's threads as fibers, barriers as generations.
#include <ucontext.h>

#include <memory>

#include "cuda_emu.h"

thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace cuda_emu {

// A barrier of `size` threads: opens (the generation moves on) when the last one arrives.
struct Barrier {
    unsigned size = 0, arrived = 0;
    uint64_t generation = 0;
};

// An asynchronous copy in flight.
struct Copy {
    void *dst;
    const void *src;
    unsigned bytes, src_bytes;  // src_bytes of src, then zeros up to bytes
};

struct Fiber {
    ucontext_t context;
    std::unique_ptr<char[]> stack;
    bool done = false;
    // The barrier it waits at (nullptr when running) and that barrier's generation then.
    Barrier *waiting = nullptr;
    uint64_t generation = 0;
    // Its asynchronous copies not yet committed, and its committed groups, oldest first.
    std::vector<Copy> open;
    std::vector<std::vector<Copy>> groups;
};

struct Launch {
    const std::function<void()> *body = nullptr;
    ucontext_t scheduler;
    std::vector<Fiber> fibers;
    Barrier block_barrier;
    std::vector<Barrier> warp_barriers;
    std::vector<uint64_t> slots;  // one shuffle slot per thread
    std::vector<float> products;  // 512 floats per warp: mma.sync's operands (cuda_emu.h)
    std::vector<uint4> shared;    // dynamic shared memory, 16-byte aligned
    unsigned shared_bytes = 0;
    unsigned running = 0;
};

thread_local Launch *current = nullptr;
thread_local unsigned lane_slot = 0;

constexpr size_t kStack = 64 * 1024;

static void set_thread_index(unsigned i) {
    lane_slot = i;
    threadIdx.x = i % blockDim.x;
    threadIdx.y = (i / blockDim.x) % blockDim.y;
    threadIdx.z = i / (blockDim.x * blockDim.y);
}

// Waits at `b`: arrives, and hands over to the scheduler until the barrier has opened.
static void wait_at(Barrier &b) {
    Launch &l = *current;
    Fiber &f = l.fibers[l.running];
    uint64_t generation = b.generation;
    if (++b.arrived == b.size) {
        b.arrived = 0;
        b.generation++;
        return;
    }
    f.waiting = &b;
    f.generation = generation;
    swapcontext(&f.context, &l.scheduler);
}

void syncthreads() { wait_at(current->block_barrier); }
void syncwarp() { wait_at(current->warp_barriers[lane_slot / 32]); }
uint64_t *my_slot() { return &current->slots[lane_slot]; }
uint64_t slot_of(unsigned src) { return current->slots[(lane_slot / 32) * 32 + src]; }
unsigned lane() { return lane_slot % 32; }
float *warp_scratch() { return &current->products[(lane_slot / 32) * 512]; }
char *dynamic_shared() { return reinterpret_cast<char *>(current->shared.data()); }
uint32_t dynamic_shared_bytes() { return current->shared_bytes; }

void copy_async(void *dst, const void *src, unsigned bytes, unsigned src_bytes) {
    std::memset(dst, 0xff, bytes);
    current->fibers[current->running].open.push_back({dst, src, bytes, src_bytes});
}

void commit_copies() {
    Fiber &f = current->fibers[current->running];
    f.groups.push_back(std::move(f.open));
    f.open.clear();
}

void wait_copies(unsigned newest_pending) {
    Fiber &f = current->fibers[current->running];
    size_t landing = f.groups.size() > newest_pending ? f.groups.size() - newest_pending : 0;
    for (size_t g = 0; g < landing; g++)
        for (const Copy &c : f.groups[g]) {
            std::memcpy(c.dst, c.src, c.src_bytes);
            std::memset(static_cast<char *>(c.dst) + c.src_bytes, 0, c.bytes - c.src_bytes);
        }
    f.groups.erase(f.groups.begin(), f.groups.begin() + landing);
}

void trap(const char *why) {
    std::fprintf(stderr, "cuda_emu: block (%u, %u, %u) thread %u trapped: %s\n", blockIdx.x,
                 blockIdx.y, blockIdx.z, threadIdx.x, why);
    std::abort();
}

static void fiber_main() {
    Launch &l = *current;
    (*l.body)();
    l.fibers[l.running].done = true;
    // returning resumes uc_link: the scheduler
}

// Runs one block to its end; false when its threads wait at barriers that can never open.
// Warp by warp: each warp runs (its lanes in turn) as far as it can before the next starts, so
// a warp reaches the next use of shared memory before the others have left the previous one,
// and a missing __syncthreads shows. `reversed` takes the warps and lanes from the last.
static bool run_block(Launch &l, unsigned threads, bool reversed) {
    for (unsigned i = 0; i < threads; i++) {
        Fiber &f = l.fibers[i];
        f.done = false;
        f.waiting = nullptr;
        f.open.clear();
        f.groups.clear();
        getcontext(&f.context);
        f.context.uc_stack.ss_sp = f.stack.get();
        f.context.uc_stack.ss_size = kStack;
        f.context.uc_link = &l.scheduler;
        makecontext(&f.context, fiber_main, 0);
    }
    std::memset(l.shared.data(), 0xff, l.shared.size() * sizeof(uint4));
    unsigned warps = threads / 32, live = threads;
    while (live > 0) {
        bool progress = false;
        for (unsigned k = 0; k < warps; k++) {
            unsigned w = reversed ? warps - 1 - k : k;
            for (bool moved = true; moved;) {
                moved = false;
                for (unsigned j = 0; j < 32; j++) {
                    unsigned i = w * 32 + (reversed ? 31 - j : j);
                    Fiber &f = l.fibers[i];
                    if (f.done || (f.waiting && f.waiting->generation == f.generation)) continue;
                    f.waiting = nullptr;
                    moved = progress = true;
                    l.running = i;
                    set_thread_index(i);
                    swapcontext(&l.scheduler, &f.context);
                    if (f.done) live--;
                }
            }
        }
        if (!progress) return false;
    }
    return true;
}

bool launch(dim3 grid, dim3 block, unsigned shared, bool reversed,
            const std::function<void()> &body) {
    unsigned threads = block.x * block.y * block.z;
    if (threads == 0 || threads > 1024 || threads % 32 != 0) {
        std::fprintf(stderr, "cuda_emu: %u threads per block (whole warps, at most 1024)\n",
                     threads);
        return false;
    }
    Launch l;
    l.body = &body;
    l.fibers.resize(threads);
    for (Fiber &f : l.fibers) f.stack.reset(new char[kStack]);
    l.block_barrier.size = threads;
    l.warp_barriers.resize(threads / 32);
    for (Barrier &b : l.warp_barriers) b.size = 32;
    l.slots.assign(threads, 0);
    l.products.assign(threads / 32 * 512, 0.0f);
    l.shared.resize((shared + 15) / 16);
    l.shared_bytes = shared;
    Launch *outer = current;
    current = &l;
    blockDim = block;
    gridDim = grid;
    bool ok = true;
    for (unsigned z = 0; z < grid.z && ok; z++)
        for (unsigned y = 0; y < grid.y && ok; y++)
            for (unsigned x = 0; x < grid.x && ok; x++) {
                blockIdx = {x, y, z};
                if (!run_block(l, threads, reversed)) {
                    std::fprintf(stderr,
                                 "cuda_emu: block (%u, %u, %u) deadlocked: threads wait at a "
                                 "barrier that others never reach\n",
                                 x, y, z);
                    ok = false;
                }
            }
    current = outer;
    return ok;
}

}  // namespace cuda_emu
