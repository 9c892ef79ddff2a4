// The fused kernels (../fused.cu) and the flash attention kernels (../flash.cu) built for the host under cuda_emu.h, for the CPU tests
// (src/kernels/gpu/emu.rs): `ds_emu_launch` takes a kernel's name and its arguments as
// cuLaunchKernel does (an array of pointers to each argument's value).
#define CUDA_EMU
#include "cuda_emu.h"

#include <utility>

#include "../flash.cu"
#include "../fused.cu"

namespace {

template <typename... A, size_t... I>
void call(void (*kernel)(A...), void **args, std::index_sequence<I...>) {
    kernel(*static_cast<A *>(args[I])...);
}

template <typename... A>
std::function<void()> bind(void (*kernel)(A...), void **args) {
    return [=] { call(kernel, args, std::index_sequence_for<A...>{}); };
}

struct Entry {
    const char *name;
    std::function<void()> (*bind)(void **);
};

#define K(name) {#name, [](void **a) { return bind(name, a); }}
#define K3(name) K(name##_f32), K(name##_bf16), K(name##_f16)
const Entry kernels[] = {
    K3(layer_norm_fwd),     K3(layer_norm_bwd),    K3(sum_partials),
    K3(layer_norm_fwd_packs), K3(layer_norm_bwd_packs),
    K3(rms_norm_fwd_packs), K3(rms_norm_bwd_packs),
    K3(column_sum_pass),    K3(column_sum_packs),  K3(gelu_fwd),
    K3(gelu_bwd),
    K3(causal_softmax_fwd), K3(softmax_bwd),       K3(cross_entropy_bwd),
    K3(cross_entropy_grad), K3(rms_norm_fwd),      K3(rms_norm_bwd),
    K3(swiglu_fwd),         K3(swiglu_bwd),        K3(rotary),
    K3(swiglu_fwd_packs),   K3(swiglu_bwd_packs),  K3(rotary_packs),
    K3(cross_entropy_lse),  K(cross_entropy_fwd_f32), K(mean_of_rows_f32),
    K3(sum_rows_by_index),
#define FLASH_K(hd, S) K(flash_fwd_hd##hd##_##S), K(flash_bwd_dkdv_hd##hd##_##S), K(flash_bwd_dq_hd##hd##_##S)
#define FLASH_K2(S) FLASH_K(32, S), FLASH_K(64, S), FLASH_K(128, S), K(flash_bwd_dot_##S)
    FLASH_K2(bf16), FLASH_K2(f16),
};

}  // namespace

// 0: ran; 1: no kernel of that name; 2: the launch failed (its reason on stderr). `shared`:
// bytes of dynamic shared memory; `reversed`: warps and lanes from the last (cuda_emu::launch).
extern "C" int ds_emu_launch(const char *name, unsigned grid, unsigned block, unsigned shared,
                             int reversed, void **args) {
    for (const Entry &e : kernels) {
        if (std::strcmp(e.name, name) != 0) continue;
        dim3 g, b;
        g.x = grid;
        b.x = block;
        return cuda_emu::launch(g, b, shared, reversed != 0, e.bind(args)) ? 0 : 2;
    }
    return 1;
}
