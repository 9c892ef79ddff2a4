//! Tests for `chart`: every case writes a real PNG, decodes it and checks the
//! size and that something beyond the background was drawn. To look at the images, set
//! `DS_CHART_KEEP=DIR`: each checked chart is copied there (`typical.png` is a training run's).

use super::*;

/// Test shorthands: the train job builds its `Series` literally.
impl<'a> Series<'a> {
    fn new(title: &'a str, y_label: &'a str, points: &'a [(f64, f64)]) -> Self {
        Series {
            title,
            y_label,
            points,
            floor: None,
        }
    }

    fn with_floor(mut self, value: f64, label: &'a str) -> Self {
        self.floor = Some((value, label));
        self
    }
}

/// A unique file in the temp dir per test, removed on drop.
struct TempPng(PathBuf);

impl TempPng {
    fn new(name: &str) -> Self {
        let file = format!("ds-chart-{}-{name}.png", std::process::id());
        Self(std::env::temp_dir().join(file))
    }
}

impl Drop for TempPng {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Deterministic noise in [-1, 1) so tests need no `rand` dependency.
fn noise(state: &mut u64) -> f64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    (*state >> 11) as f64 / (1u64 << 52) as f64 - 1.0
}

/// `(step, value)` points of one metric.
type Points = Vec<(f64, f64)>;

/// 200 steps of loss falling 5.5 -> 2.1 and tokens/s around 3000.
fn typical_run() -> (Points, Points) {
    let mut state = 0x2545_f491_4f6c_dd1d;
    let mut loss = Vec::new();
    let mut tps = Vec::new();
    for step in 1..=200 {
        let t = f64::from(step);
        let decay = 2.1 + 3.4 * (-(t - 1.0) / 45.0).exp();
        loss.push((t, decay + 0.08 * noise(&mut state)));
        tps.push((t, 3000.0 + 120.0 * noise(&mut state)));
    }
    (loss, tps)
}

/// Decoded RGB8 image: (width, height, pixels).
fn decode(path: &Path) -> (u32, u32, Vec<u8>) {
    let file = std::fs::File::open(path).expect("png exists");
    let decoder = png::Decoder::new(std::io::BufReader::new(file));
    let mut reader = decoder.read_info().expect("png header");
    let mut buf = vec![0; reader.output_buffer_size().expect("buffer size")];
    let info = reader.next_frame(&mut buf).expect("png frame");
    assert_eq!(info.color_type, png::ColorType::Rgb);
    buf.truncate(info.buffer_size());
    (info.width, info.height, buf)
}

/// Pixels that are not pure white.
fn ink(pixels: &[u8]) -> usize {
    pixels.chunks(3).filter(|p| p != &[255, 255, 255]).count()
}

/// Pixels close to `color`, i.e. the data line or markers of that series.
fn count_color(pixels: &[u8], color: RGBColor) -> usize {
    let close = |a: u8, b: u8| a.abs_diff(b) < 8;
    pixels
        .chunks(3)
        .filter(|p| close(p[0], color.0) && close(p[1], color.1) && close(p[2], color.2))
        .count()
}

/// Writes, decodes and checks the size; returns the pixels for more checks.
fn render_and_check(name: &str, series: &[Series]) -> Vec<u8> {
    let out = TempPng::new(name);
    write_png(&out.0, name, series).expect("chart written");
    if let Some(dir) = std::env::var_os("DS_CHART_KEEP") {
        let _ = std::fs::copy(&out.0, Path::new(&dir).join(format!("{name}.png")));
    }
    let (w, h, pixels) = decode(&out.0);
    assert_eq!(w, WIDTH);
    assert_eq!(h, TITLE_HEIGHT + PANEL_HEIGHT * series.len() as u32);
    let total = (w * h) as usize;
    let drawn = ink(&pixels);
    assert!(
        drawn > total / 100,
        "{name}: only {drawn} of {total} pixels drawn"
    );
    assert!(drawn < total / 2, "{name}: {drawn} of {total} pixels drawn");
    pixels
}

#[test]
fn typical_run_draws_both_lines() {
    let (loss, tps) = typical_run();
    let series = [
        Series::new("training loss", "loss", &loss).with_floor(1.9, "entropy floor"),
        Series::new("throughput", "tokens/s", &tps),
    ];
    let pixels = render_and_check("typical", &series);
    assert!(count_color(&pixels, PALETTE[0]) > 1000, "loss line missing");
    assert!(
        count_color(&pixels, PALETTE[1]) > 1000,
        "tokens/s line missing"
    );
    assert!(
        count_color(&pixels, FLOOR_COLOR) > 300,
        "floor line missing"
    );
}

#[test]
fn single_point_is_visible() {
    let one = [(7.0, 3.25)];
    let pixels = render_and_check("single", &[Series::new("loss", "loss", &one)]);
    assert!(count_color(&pixels, PALETTE[0]) > 20, "marker missing");
}

#[test]
fn constant_series_is_drawn() {
    let flat: Points = (0..50).map(|s| (f64::from(s), 3000.0)).collect();
    let pixels = render_and_check("constant", &[Series::new("tps", "tokens/s", &flat)]);
    assert!(count_color(&pixels, PALETTE[0]) > 500, "flat line missing");
}

#[test]
fn non_finite_values_are_skipped() {
    let (mut loss, _) = typical_run();
    loss[10].1 = f64::NAN;
    loss[50].1 = f64::INFINITY;
    loss[60].1 = f64::NEG_INFINITY;
    loss[70].0 = f64::NAN;
    let pixels = render_and_check("nan", &[Series::new("loss", "loss", &loss)]);
    assert!(count_color(&pixels, PALETTE[0]) > 1000, "line missing");
}

#[test]
fn all_nan_or_empty_series_render_a_note() {
    let nan = [(f64::NAN, f64::NAN), (1.0, f64::NAN)];
    let series = [
        Series::new("loss", "loss", &nan).with_floor(f64::NAN, "floor"),
        Series::new("tps", "tokens/s", &[]),
    ];
    render_and_check("all-nan", &series);
}

#[test]
fn extreme_values_do_not_panic() {
    let huge = [(0.0, -f64::MAX), (1.0, f64::MAX)];
    let tiny = [(0.0, 1e-300), (1.0, 1.000_000_000_000_1e-300)];
    let negative_steps = [(-5.0, 1.0), (-1e12, 2.0), (1e12, 0.0)];
    let subnormal = [(0.0, f64::MIN_POSITIVE / 4.0), (0.0, 0.0)];
    let series = [
        Series::new("huge", "v", &huge),
        Series::new("tiny", "v", &tiny).with_floor(f64::MAX, "max"),
        Series::new("steps", "v", &negative_steps),
        Series::new("subnormal", "v", &subnormal),
    ];
    render_and_check("extreme", &series);
}

#[test]
fn empty_and_too_many_series_are_errors() {
    let out = TempPng::new("none");
    let err = write_png(&out.0, "t", &[]).expect_err("no series");
    assert!(err.to_string().contains(&out.0.display().to_string()));
    let one = [(1.0, 1.0)];
    let many = vec![Series::new("s", "v", &one); MAX_PANELS + 1];
    assert!(matches!(
        write_png(&out.0, "t", &many),
        Err(ChartError::Input { .. })
    ));
}

#[test]
fn unwritable_path_names_the_path() {
    let path = std::env::temp_dir().join("ds-chart-no-such-dir/x/chart.png");
    let one = [(1.0, 1.0)];
    let err = write_png(&path, "t", &[Series::new("s", "v", &one)]).expect_err("io error");
    assert!(matches!(err, ChartError::Io { .. }));
    assert!(err.to_string().contains("ds-chart-no-such-dir"), "{err}");
}

#[test]
fn tick_labels_are_short() {
    assert_eq!(format_tick(150.0, 20.0), "150");
    assert_eq!(format_tick(2.500_000_000_000_4, 0.5), "2.5");
    assert_eq!(format_tick(-1e-17, 0.5), "0.0");
    assert_eq!(format_tick(-0.01, 0.5), "0.0");
    assert_eq!(format_tick(0.0123, 0.005), "0.012");
    assert_eq!(format_tick(3.0e9, 1.0e8), "3.00e9");
    assert_eq!(format_value(2.134_567), "2.135");
    assert_eq!(format_value(3012.4), "3012");
    assert_eq!(format_value(1.9), "1.9");
    assert_eq!(format_value(0.0), "0");
}

#[test]
fn ranges_are_finite_and_non_empty() {
    let cases: [&[f64]; 6] = [
        &[],
        &[5.0],
        &[0.0, 0.0],
        &[-f64::MAX, f64::MAX],
        &[f64::MAX, f64::MAX],
        &[1e-300, 1.000_000_000_000_1e-300],
    ];
    for values in cases {
        let r = padded_range(values.iter().copied(), 0.05);
        assert!(
            r.start.is_finite() && r.end.is_finite(),
            "{values:?}: {r:?}"
        );
        assert!(r.start < r.end, "{values:?}: {r:?}");
    }
    assert_eq!(padded_range([2.0, 4.0].into_iter(), 0.0), 2.0..4.0);
}

#[test]
fn caption_reports_last_value_and_skipped_points() {
    let points = [(2.0, 1.5), (1.0, 9.0), (3.0, f64::NAN)];
    let data = PanelData::new(&Series::new("loss", "loss", &points));
    assert_eq!(data.points, vec![(1.0, 9.0), (2.0, 1.5)]);
    assert_eq!(
        caption("loss", &data),
        "loss  (last: 1.5, 1 non-finite skipped)"
    );
    let empty = PanelData::new(&Series::new("loss", "loss", &[]));
    assert_eq!(caption("loss", &empty), "loss");
}

#[test]
fn long_run_renders() {
    let points: Points = (0..200_000)
        .map(|s| (f64::from(s), 1.0 / f64::from(s + 1)))
        .collect();
    render_and_check("long", &[Series::new("loss", "loss", &points)]);
}
