//! A linear layer's row-major products as cuBLAS's column-major GEMM, and what cuBLASLt's
//! epilogue does to the product before it stores it (lt.rs runs them; the tests below hold
//! the descriptions to the row-major products through cuBLAS's documented semantics).
//!
//! Note [row-major as column-major]: a row-major [r, c] matrix, read column-major with
//! leading dimension c, is its transpose [c, r]. So a row-major product Y = X W^T (X [r, i],
//! W [o, i]) is the column-major Y^T [o, r] = op(W) op(X), with W's [i, o] transposed and X's
//! [i, r] as it lies: D's rows are Y's columns, the output features, which is where cuBLASLt
//! puts a bias (one per row of D) and where the GELU epilogues keep their auxiliary matrix
//! (row-major [r, o] again, leading dimension o).

/// What cuBLASLt applies to the product `P = op(A) op(B)` before storing D.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Epilogue {
    /// D = P + bias, a bias per row of D (`CUBLASLT_EPILOGUE_BIAS`).
    Bias,
    /// aux = P + bias, D = gelu(aux), tanh-GELU (`CUBLASLT_EPILOGUE_GELU_AUX_BIAS`).
    GeluAuxBias,
    /// D = P * gelu'(aux), aux read (`CUBLASLT_EPILOGUE_DGELU`).
    DGelu,
}

impl Epilogue {
    /// Whether it reads or writes the auxiliary matrix (D's shape, leading dimension m).
    pub(crate) fn has_aux(self) -> bool {
        matches!(self, Epilogue::GeluAuxBias | Epilogue::DGelu)
    }

    pub(crate) fn has_bias(self) -> bool {
        matches!(self, Epilogue::Bias | Epilogue::GeluAuxBias)
    }
}

/// D (m x n, column-major, leading dimension `ldd`) = op(A) op(B), where op(A) is m x k and
/// op(B) k x n; `transa`/`transb`: the operand is stored transposed (cuBLAS's OP_T).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Gemm {
    pub transa: bool,
    pub transb: bool,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub lda: usize,
    pub ldb: usize,
    pub ldd: usize,
}

impl Gemm {
    /// y [rows, out] = x [rows, inp] w [out, inp]^T: A = w, B = x, D = y (Note [row-major as
    /// column-major]); a bias or aux belongs to the `out` features.
    pub(crate) fn linear(rows: usize, inp: usize, out: usize) -> Gemm {
        Gemm {
            transa: true,
            transb: false,
            m: out,
            n: rows,
            k: inp,
            lda: inp,
            ldb: inp,
            ldd: out,
        }
    }

    /// linear's input gradient dx [rows, inp] = dy [rows, out] w [out, inp]: A = w, B = dy,
    /// D = dx; an aux is [rows, inp] row-major.
    pub(crate) fn input_grad(rows: usize, inp: usize, out: usize) -> Gemm {
        Gemm {
            transa: false,
            transb: false,
            m: inp,
            n: rows,
            k: out,
            lda: inp,
            ldb: out,
            ldd: inp,
        }
    }

    /// A as stored: (rows, columns) column-major.
    pub(crate) fn a_stored(&self) -> (usize, usize) {
        match self.transa {
            true => (self.k, self.m),
            false => (self.m, self.k),
        }
    }

    /// B as stored: (rows, columns) column-major.
    pub(crate) fn b_stored(&self) -> (usize, usize) {
        match self.transb {
            true => (self.n, self.k),
            false => (self.k, self.n),
        }
    }

    /// Whether cuBLASLt takes `epilogue` on this product: the GELU epilogues' auxiliary
    /// matrix needs a leading dimension divisible by 8 (cuBLASLt's rule for it).
    pub(crate) fn takes(&self, epilogue: Epilogue) -> bool {
        let dims = [self.m, self.n, self.k].iter().all(|&d| d > 0);
        dims && (!epilogue.has_aux() || self.ldd.is_multiple_of(8))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// tanh-GELU, the GPT-2 activation cuBLASLt's GELU epilogues apply.
    fn gelu(x: f64) -> f64 {
        let c = (2.0 / std::f64::consts::PI).sqrt();
        0.5 * x * (1.0 + (c * (x + 0.044715 * x.powi(3))).tanh())
    }

    fn gelu_grad(x: f64) -> f64 {
        let c = (2.0 / std::f64::consts::PI).sqrt();
        let t = (c * (x + 0.044715 * x.powi(3))).tanh();
        0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * x * x)
    }

    /// cuBLASLt's matmul as its documentation states it, in f64: column-major storage,
    /// op(A)[i][p] = A[i + p lda] (or A[p + i lda] transposed), the same for B, then the
    /// epilogue. Returns D (column-major, `ldd`) and, for GeluAuxBias, aux.
    fn cublaslt(
        g: &Gemm,
        e: Option<Epilogue>,
        a: &[f64],
        b: &[f64],
        bias: &[f64],
        aux_in: &[f64],
    ) -> (Vec<f64>, Vec<f64>) {
        let op_a = |i: usize, p: usize| match g.transa {
            true => a[p + i * g.lda],
            false => a[i + p * g.lda],
        };
        let op_b = |p: usize, j: usize| match g.transb {
            true => b[j + p * g.ldb],
            false => b[p + j * g.ldb],
        };
        let bias_of = |i: usize| bias[i];
        let mut d = vec![f64::NAN; g.ldd * g.n];
        let mut aux = vec![f64::NAN; g.ldd * g.n];
        for j in 0..g.n {
            for i in 0..g.m {
                let p: f64 = (0..g.k).map(|p| op_a(i, p) * op_b(p, j)).sum();
                let at = i + j * g.ldd;
                let Some(e) = e else {
                    d[at] = p;
                    continue;
                };
                let v = if e.has_bias() { p + bias_of(i) } else { p };
                d[at] = match e {
                    Epilogue::Bias => v,
                    Epilogue::GeluAuxBias => {
                        aux[at] = v;
                        gelu(v)
                    }
                    Epilogue::DGelu => v * gelu_grad(aux_in[at]),
                };
            }
        }
        (d, aux)
    }

    /// Small integers: every product and sum is exact in f64, so the two orders agree bit
    /// for bit.
    fn ints(n: usize, seed: usize) -> Vec<f64> {
        (0..n)
            .map(|i| ((i * 7 + seed * 13) % 11) as f64 - 5.0)
            .collect()
    }

    /// Row-major y [rows, out] = x [rows, inp] w [out, inp]^T + b, by definition.
    fn linear_rows(
        x: &[f64],
        w: &[f64],
        b: &[f64],
        (rows, inp, out): (usize, usize, usize),
    ) -> Vec<f64> {
        let mut y = vec![0.0; rows * out];
        for r in 0..rows {
            for o in 0..out {
                let s: f64 = (0..inp).map(|i| x[r * inp + i] * w[o * inp + i]).sum();
                y[r * out + o] = s + b[o];
            }
        }
        y
    }

    const SIZES: [(usize, usize, usize); 3] = [(5, 3, 8), (16, 8, 24), (7, 16, 8)];

    #[test]
    fn linear_is_the_row_major_product_plus_bias() {
        for (rows, inp, out) in SIZES {
            let (x, w, b) = (ints(rows * inp, 1), ints(out * inp, 2), ints(out, 3));
            let g = Gemm::linear(rows, inp, out);
            assert_eq!((g.a_stored(), g.b_stored()), ((inp, out), (inp, rows)));
            let (d, _) = cublaslt(&g, Some(Epilogue::Bias), &w, &x, &b, &[]);
            assert_eq!(
                d,
                linear_rows(&x, &w, &b, (rows, inp, out)),
                "{rows}x{inp}x{out}"
            );
        }
    }

    #[test]
    fn gelu_aux_keeps_the_pre_activation_row_major() {
        for (rows, inp, out) in SIZES {
            let (x, w, b) = (ints(rows * inp, 4), ints(out * inp, 5), ints(out, 6));
            let g = Gemm::linear(rows, inp, out);
            let (d, aux) = cublaslt(&g, Some(Epilogue::GeluAuxBias), &w, &x, &b, &[]);
            let f = linear_rows(&x, &w, &b, (rows, inp, out));
            assert_eq!(aux, f);
            assert_eq!(d, f.iter().map(|&v| gelu(v)).collect::<Vec<_>>());
        }
    }

    #[test]
    fn input_grad_through_gelu_is_dy_w_times_gelu_prime() {
        for (rows, inp, out) in SIZES {
            let (dy, w) = (ints(rows * out, 7), ints(out * inp, 8));
            // the pre-activation, row-major [rows, inp], as the forward's aux left it
            let f: Vec<f64> = ints(rows * inp, 9).iter().map(|v| v / 4.0).collect();
            let g = Gemm::input_grad(rows, inp, out);
            let (d, _) = cublaslt(&g, Some(Epilogue::DGelu), &w, &dy, &[], &f);
            for r in 0..rows {
                for i in 0..inp {
                    let s: f64 = (0..out).map(|o| dy[r * out + o] * w[o * inp + i]).sum();
                    let want = s * gelu_grad(f[r * inp + i]);
                    assert_eq!(d[r * inp + i], want, "{rows}x{inp}x{out} at ({r}, {i})");
                }
            }
        }
    }

    #[test]
    fn gelu_grad_is_the_derivative_of_gelu() {
        for x in [-4.0, -1.3, -0.2, 0.0, 0.7, 2.5] {
            let h = 1e-5;
            let numeric = (gelu(x + h) - gelu(x - h)) / (2.0 * h);
            assert!((gelu_grad(x) - numeric).abs() < 1e-8, "at {x}");
        }
    }

    #[test]
    fn aux_epilogues_need_a_leading_dimension_of_eight() {
        assert!(Gemm::linear(16, 8, 24).takes(Epilogue::GeluAuxBias));
        assert!(!Gemm::linear(16, 8, 20).takes(Epilogue::GeluAuxBias));
        assert!(Gemm::linear(16, 8, 20).takes(Epilogue::Bias));
        assert!(!Gemm::input_grad(16, 12, 8).takes(Epilogue::DGelu));
        assert!(!Gemm::linear(0, 8, 8).takes(Epilogue::Bias));
    }
}
