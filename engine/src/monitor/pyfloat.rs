//! Python's `repr(float)`, the text `csv.writer` gives a float. DeepSpeed's CSV files hold
//! `1e-05`, `65536.0`, `0.30000000000000004`; Rust's `{}` would print `0.00001` and `65536`.
//!
//! Both languages pick the shortest digit string that reads back to the same double; the layout
//! differs, and so does the pick between two equally near strings (see `shortest_digits`).
//! Python switches to exponent form when the decimal exponent is below -4 or
//! at least 16 and then writes at least two exponent digits with a sign (`1e+16`).

/// `repr(x)` for a Python float.
pub(crate) fn py_float_repr(x: f64) -> String {
    if x.is_nan() {
        return "nan".to_string();
    }
    if x.is_infinite() {
        return if x > 0.0 { "inf" } else { "-inf" }.to_string();
    }
    let (digits, exp) = shortest_digits(x.abs());
    let sign = if x.is_sign_negative() { "-" } else { "" };
    let body = if (-4..16).contains(&exp) {
        positional(&digits, exp)
    } else {
        exponential(&digits, exp)
    };
    format!("{sign}{body}")
}

/// The shortest round-trip significant digits of a finite non-negative `x` and its decimal
/// exponent: x = d.ddd * 10^exp. Rust's `{:e}` finds the shortest length, but when two strings
/// of that length both read back to `x` and sit equally far from it, it may take the upper one
/// (1113178120592002.25 -> ...002.3) where Python rounds half to even (...002.2). So the
/// correctly rounded string of the same length (Rust's `{:.N e}` rounds half to even) is used
/// whenever it also reads back to `x`.
fn shortest_digits(x: f64) -> (String, i32) {
    let shortest = format!("{x:e}");
    let (mantissa, _) = shortest.split_once('e').unwrap_or((&shortest, "0"));
    let decimals = mantissa.len().saturating_sub(2); // digits after "d."
    let nearest = format!("{x:.decimals$e}");
    let chosen = if nearest.parse::<f64>() == Ok(x) {
        nearest
    } else {
        shortest
    };
    let (mantissa, exp) = chosen.split_once('e').unwrap_or((&chosen, "0"));
    (mantissa.replace('.', ""), exp.parse().unwrap_or(0))
}

/// `123.45`, `0.0001`, `65536.0`: always a point, and a digit on each side of it.
fn positional(digits: &str, exp: i32) -> String {
    if exp < 0 {
        let zeros = "0".repeat((-exp - 1) as usize);
        return format!("0.{zeros}{digits}");
    }
    let int_len = exp as usize + 1;
    if digits.len() <= int_len {
        let zeros = "0".repeat(int_len - digits.len());
        format!("{digits}{zeros}.0")
    } else {
        format!("{}.{}", &digits[..int_len], &digits[int_len..])
    }
}

/// `1e-05`, `1.2345678901234568e+17`.
fn exponential(digits: &str, exp: i32) -> String {
    let (lead, rest) = digits.split_at(1);
    let sign = if exp < 0 { '-' } else { '+' };
    let point = if rest.is_empty() { "" } else { "." };
    format!("{lead}{point}{rest}e{sign}{:02}", exp.unsigned_abs())
}

#[cfg(test)]
mod tests {
    use super::py_float_repr;

    #[test]
    fn matches_python_repr() {
        // Right-hand sides printed by Python 3.11's repr() for the same literals.
        let cases = [
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (1.0, "1.0"),
            (65536.0, "65536.0"),
            (2.5, "2.5"),
            (0.1 + 0.2, "0.30000000000000004"),
            (0.0001, "0.0001"),
            (1e-5, "1e-05"),
            (1.5e-5, "1.5e-05"),
            (2.5e-7, "2.5e-07"),
            (6e-5, "6e-05"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (123456789012345678.0, "1.2345678901234568e+17"),
            (-3.25e100, "-3.25e+100"),
            (5e-324, "5e-324"),
            (f64::MAX, "1.7976931348623157e+308"),
            (f64::INFINITY, "inf"),
            (f64::NEG_INFINITY, "-inf"),
            (f64::NAN, "nan"),
            (123.456, "123.456"),
            (1234567.0, "1234567.0"),
            // Exact ties between two shortest strings: Python rounds half to even. Written as
            // sums because each value is exact but has more digits than its shortest form.
            (-(1113178120592002.0 + 0.25), "-1113178120592002.2"),
            (-(233891771783429.0 + 0.625), "-233891771783429.62"),
            (2152548015248394.0 + 0.25, "2152548015248394.2"),
        ];
        for (x, expected) in cases {
            assert_eq!(py_float_repr(x), expected, "repr of {x:e}");
        }
    }
}
