//! The transformer blocks every family is made of, each defined once with its backward: the
//! token embedding (with learned positions or without), the norms (LayerNorm, RMSNorm), the MLP
//! (GELU or SwiGLU, dense or an expert), the final norm with the LM head (tied or untied, vocabulary-parallel, tiled into the loss). A
//! family configures them and names their parameters; it does not write them again.

mod attention;
mod embedding;
mod head;
mod mlp;
mod norm;
pub mod rope;

pub use attention::{Attention, AttentionGrads, AttentionKept, AttentionWeights, Projection};
pub use embedding::{Embedding, Positions};
pub use head::Head;
pub use mlp::{swiglu, swiglu_backward, Activation, Gelu, Linear, MlpGrads, MlpKept, MlpWeights};
pub use norm::{rms_norm, rms_norm_backward, Norm};

/// Token positions in an input of `shape` ([B, T] ids or [B, T, d] activations).
pub(crate) fn rows(shape: &[usize]) -> usize {
    shape.iter().take(2).product()
}
