//! End-of-run training charts: one PNG with a panel per metric (loss,
//! tokens/s, ...) stacked vertically over the optimizer step.
//!
//! Text is rendered with a bundled ASCII subset of DejaVu Sans through
//! plotters' `ab_glyph` feature, so the build needs no fontconfig, freetype
//! or system fonts. The PNG is encoded with the `png` crate from an RGB buffer
//! instead of plotters' `image` encoder, which keeps the dependency tree small.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use plotters::style::{register_font, FontStyle};

/// Image width in pixels; wide enough for ~10 x-ticks with 6-digit steps.
pub const WIDTH: u32 = 1000;
/// Height of one metric panel in pixels.
pub const PANEL_HEIGHT: u32 = 340;
/// Height of the strip that holds the overall title.
pub const TITLE_HEIGHT: u32 = 48;
/// More panels than this would make an unreadably tall image; treat as a bug.
pub const MAX_PANELS: usize = 12;
/// Series with at most this many points also get a marker per point, so a
/// short run (or a single point) is visible even where the line is not.
const MARKER_LIMIT: usize = 60;

/// Family name the bundled font is registered under; private so that no
/// other font registration in the process can collide with it.
const FONT: &str = "ds-chart-dejavu-sans";
/// ASCII (+ a few symbols) subset of DejaVu Sans 2.37; see the LICENSE file
/// next to it (Bitstream Vera licence, DejaVu changes public domain).
const FONT_BYTES: &[u8] = include_bytes!("../../assets/fonts/DejaVuSans-subset.ttf");

const BACKGROUND: RGBColor = WHITE;
const GRID: RGBColor = RGBColor(215, 215, 215);
const LIGHT_GRID: RGBColor = RGBColor(244, 244, 244);
const FLOOR_COLOR: RGBColor = RGBColor(200, 40, 40);
const PALETTE: [RGBColor; 4] = [
    RGBColor(31, 100, 180),
    RGBColor(230, 120, 20),
    RGBColor(40, 150, 60),
    RGBColor(140, 70, 170),
];

/// One metric over optimizer steps, drawn as its own panel.
#[derive(Debug, Clone, Copy)]
pub struct Series<'a> {
    /// Panel title, e.g. "training loss".
    pub title: &'a str,
    /// Y axis title, e.g. "loss (nats)".
    pub y_label: &'a str,
    /// `(step, value)` pairs; non-finite pairs are skipped.
    pub points: &'a [(f64, f64)],
    /// Optional horizontal reference line `(value, label)`, e.g. the data's
    /// entropy floor, so the reader sees how far the loss can still fall.
    pub floor: Option<(f64, &'a str)>,
}

/// Why a chart could not be written; always names the target file.
#[derive(Debug, thiserror::Error)]
pub enum ChartError {
    /// The caller passed no series or more than [`MAX_PANELS`].
    #[error("chart {}: {reason}", path.display())]
    Input { path: PathBuf, reason: String },
    /// The bundled font or plotters failed while drawing.
    #[error("chart {}: drawing failed: {reason}", path.display())]
    Draw { path: PathBuf, reason: String },
    /// The file could not be created or written.
    #[error("chart {}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The PNG encoder rejected the image or failed writing it.
    #[error("chart {}: PNG encoding failed: {source}", path.display())]
    Encode {
        path: PathBuf,
        source: png::EncodingError,
    },
}

/// Writes a PNG at `path` with `title` on top and one panel per series
/// stacked vertically, all sharing "optimizer step" as the x axis title.
pub fn write_png(path: &Path, title: &str, series: &[Series]) -> Result<(), ChartError> {
    write_png_over(path, title, "optimizer step", series)
}

/// `write_png` with another x axis title.
pub fn write_png_over(
    path: &Path,
    title: &str,
    x_label: &str,
    series: &[Series],
) -> Result<(), ChartError> {
    check_panel_count(path, series.len())?;
    let height = TITLE_HEIGHT + PANEL_HEIGHT * series.len() as u32;
    let pixels = render(title, x_label, series, height).map_err(|reason| ChartError::Draw {
        path: path.to_path_buf(),
        reason,
    })?;
    encode_png(path, &pixels, WIDTH, height)
}

/// Rejects an empty chart (a caller bug) and absurdly tall images.
fn check_panel_count(path: &Path, count: usize) -> Result<(), ChartError> {
    let reason = match count {
        0 => "no series to plot".to_string(),
        n if n > MAX_PANELS => format!("{n} series, at most {MAX_PANELS} panels"),
        _ => return Ok(()),
    };
    Err(ChartError::Input {
        path: path.to_path_buf(),
        reason,
    })
}

/// Registers the bundled font once per process; plotters keeps a global table.
fn ensure_font() -> Result<(), String> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok = *REGISTERED.get_or_init(|| register_font(FONT, FontStyle::Normal, FONT_BYTES).is_ok());
    if ok {
        Ok(())
    } else {
        Err("bundled font could not be parsed".to_string())
    }
}

/// Draws the whole chart into an RGB8 buffer of `WIDTH x height`.
fn render(title: &str, x_label: &str, series: &[Series], height: u32) -> Result<Vec<u8>, String> {
    ensure_font()?;
    let mut pixels = vec![0u8; WIDTH as usize * height as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut pixels, (WIDTH, height)).into_drawing_area();
        root.fill(&BACKGROUND).map_err(|e| e.to_string())?;
        let body = root
            .titled(title, (FONT, 26).into_font().color(&BLACK))
            .map_err(|e| e.to_string())?;
        let panels = body.split_evenly((series.len(), 1));
        for (index, (panel, s)) in panels.iter().zip(series).enumerate() {
            draw_panel(panel, s, x_label, PALETTE[index % PALETTE.len()])?;
        }
        root.present().map_err(|e| e.to_string())?;
    }
    Ok(pixels)
}

/// Axis ranges and data of one panel after dropping non-finite values.
struct PanelData {
    /// Finite points sorted by step, so an out-of-order log still draws a
    /// left-to-right line.
    points: Vec<(f64, f64)>,
    /// How many input points were NaN/inf; a diverged run must not look clean.
    skipped: usize,
    floor: Option<(f64, String)>,
    x: Range<f64>,
    y: Range<f64>,
}

impl PanelData {
    fn new(series: &Series) -> Self {
        let mut points: Vec<(f64, f64)> = series
            .points
            .iter()
            .copied()
            .filter(|(x, y)| x.is_finite() && y.is_finite())
            .collect();
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        let floor = series
            .floor
            .filter(|(v, _)| v.is_finite())
            .map(|(v, label)| (v, label.to_string()));
        let xs = points.iter().map(|p| p.0);
        let ys = points.iter().map(|p| p.1).chain(floor.iter().map(|f| f.0));
        Self {
            x: padded_range(xs, 0.0),
            y: padded_range(ys, 0.05),
            skipped: series.points.len() - points.len(),
            points,
            floor,
        }
    }
}

/// Min..max of finite `values` widened by `margin` of the span on each side.
/// Degenerate inputs (no values, one value, a constant) still give a
/// non-empty range so plotters has something to put ticks on.
fn padded_range(values: impl Iterator<Item = f64>, margin: f64) -> Range<f64> {
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    if lo > hi {
        return 0.0..1.0;
    }
    let span = hi - lo;
    let pad = if span > 0.0 {
        span * margin
    } else {
        (lo.abs() * 0.1).max(1.0)
    };
    let (a, b) = (lo - pad, hi + pad);
    if a.is_finite() && b.is_finite() && a < b {
        a..b
    } else if span.is_finite() && span > 0.0 {
        // Values near f64::MAX: the padding overflowed, so go without it.
        lo..hi
    } else {
        // The span itself overflows; plotters needs a finite width, so show
        // the widest range that has one and let the extremes clip.
        -f64::MAX / 2.0..f64::MAX / 2.0
    }
}

/// Draws one metric panel: caption, mesh with numeric ticks, line, markers
/// for short series, the optional reference line, and a note when empty.
fn draw_panel(
    area: &DrawingArea<BitMapBackend, Shift>,
    series: &Series,
    x_label: &str,
    color: RGBColor,
) -> Result<(), String> {
    let data = PanelData::new(series);
    let mut chart = ChartBuilder::on(area)
        .caption(caption(series.title, &data), (FONT, 20))
        .margin_left(12)
        .margin_right(24)
        .margin_bottom(8)
        .x_label_area_size(44)
        .y_label_area_size(76)
        .build_cartesian_2d(data.x.clone(), data.y.clone())
        .map_err(|e| e.to_string())?;
    draw_mesh(&mut chart, x_label, series.y_label, &data)?;
    draw_data(&mut chart, &data, color)?;
    draw_floor(&mut chart, &data)?;
    if data.points.is_empty() {
        draw_empty_note(&mut chart, &data)?;
    }
    Ok(())
}

type Chart<'a, 'b> =
    ChartContext<'a, BitMapBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// Panel title plus the last value, which is usually what the reader wants,
/// and the number of dropped non-finite points, which would otherwise be
/// invisible.
fn caption(title: &str, data: &PanelData) -> String {
    let mut notes = Vec::new();
    if let Some(&(_, y)) = data.points.last() {
        notes.push(format!("last: {}", format_value(y)));
    }
    if data.skipped > 0 {
        notes.push(format!("{} non-finite skipped", data.skipped));
    }
    if notes.is_empty() {
        title.to_string()
    } else {
        format!("{title}  ({})", notes.join(", "))
    }
}

/// Grid, axes, tick labels and axis titles.
fn draw_mesh(
    chart: &mut Chart,
    x_label: &str,
    y_label: &str,
    data: &PanelData,
) -> Result<(), String> {
    let x_step = (data.x.end - data.x.start) / 10.0;
    let y_step = (data.y.end - data.y.start) / 8.0;
    let x_fmt = move |v: &f64| format_tick(*v, x_step);
    let y_fmt = move |v: &f64| format_tick(*v, y_step);
    chart
        .configure_mesh()
        .light_line_style(LIGHT_GRID)
        .bold_line_style(GRID)
        .x_labels(10)
        .y_labels(8)
        .x_label_formatter(&x_fmt)
        .y_label_formatter(&y_fmt)
        .x_desc(x_label)
        .y_desc(y_label)
        .label_style((FONT, 14))
        .axis_desc_style((FONT, 16))
        .draw()
        .map_err(|e| e.to_string())
}

/// The series line, plus a marker per point when there are few points.
fn draw_data(chart: &mut Chart, data: &PanelData, color: RGBColor) -> Result<(), String> {
    let line = LineSeries::new(data.points.iter().copied(), color.stroke_width(2));
    chart.draw_series(line).map_err(|e| e.to_string())?;
    if data.points.len() <= MARKER_LIMIT {
        let markers = data
            .points
            .iter()
            .map(|&p| Circle::new(p, 4, color.filled()));
        chart.draw_series(markers).map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// Dashed reference line across the panel with its label above the left end.
fn draw_floor(chart: &mut Chart, data: &PanelData) -> Result<(), String> {
    let Some((value, label)) = &data.floor else {
        return Ok(());
    };
    let ends = [(data.x.start, *value), (data.x.end, *value)];
    let dashed = DashedLineSeries::new(ends, 8, 5, FLOOR_COLOR.stroke_width(2));
    chart.draw_series(dashed).map_err(|e| e.to_string())?;
    let text = format!("{label} = {}", format_value(*value));
    let style = (FONT, 14)
        .into_font()
        .color(&FLOOR_COLOR)
        .pos(Pos::new(HPos::Left, VPos::Bottom));
    let at = (data.x.start + (data.x.end - data.x.start) * 0.01, *value);
    chart
        .draw_series(std::iter::once(Text::new(text, at, style)))
        .map_err(|e| e.to_string())?;
    Ok(())
}

/// Says so in the middle of a panel whose series had no finite points, so an
/// empty panel is not mistaken for a rendering bug.
fn draw_empty_note(chart: &mut Chart, data: &PanelData) -> Result<(), String> {
    let mid = (
        (data.x.start + data.x.end) / 2.0,
        (data.y.start + data.y.end) / 2.0,
    );
    let style = (FONT, 18)
        .into_font()
        .color(&RGBColor(120, 120, 120))
        .pos(Pos::new(HPos::Center, VPos::Center));
    chart
        .draw_series(std::iter::once(Text::new("no finite data", mid, style)))
        .map_err(|e| e.to_string())?;
    Ok(())
}

/// Tick label with as many decimals as the tick spacing `step` needs, so
/// labels read "2.5" rather than "2.5000000000000004" and steps read "150".
fn format_tick(v: f64, step: f64) -> String {
    // Float noise turns the zero tick into e.g. -1e-17; show it as zero.
    let v = if v.abs() < step.abs() * 1e-6 { 0.0 } else { v };
    if use_exponent(v) {
        return format!("{v:.2e}");
    }
    let decimals = if step.is_finite() && step > 0.0 && step < 1.0 {
        (-step.log10()).ceil().clamp(0.0, 6.0) as usize
    } else {
        0
    };
    let text = format!("{v:.decimals$}");
    // "-0" and "-0.00" look like a bug on an axis.
    if text
        .trim_start_matches('-')
        .chars()
        .all(|c| c == '0' || c == '.')
    {
        text.trim_start_matches('-').to_string()
    } else {
        text
    }
}

/// A single value (last point, floor) with four significant digits.
fn format_value(v: f64) -> String {
    if use_exponent(v) {
        return format!("{v:.3e}");
    }
    let magnitude = if v == 0.0 {
        0.0
    } else {
        v.abs().log10().floor()
    };
    let decimals = (3.0 - magnitude).clamp(0.0, 6.0) as usize;
    let text = format!("{v:.decimals$}");
    if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        text
    }
}

/// Very large or very small magnitudes would need too many digits.
fn use_exponent(v: f64) -> bool {
    let a = v.abs();
    a >= 1e7 || (a > 0.0 && a < 1e-4)
}

/// Encodes the RGB8 buffer in memory, then writes it in one call so that an
/// I/O error (disk full, missing directory) is reported rather than lost in a
/// buffered writer's drop.
fn encode_png(path: &Path, pixels: &[u8], width: u32, height: u32) -> Result<(), ChartError> {
    let enc_err = |source| ChartError::Encode {
        path: path.to_path_buf(),
        source,
    };
    let mut bytes = Vec::new();
    let mut encoder = png::Encoder::new(&mut bytes, width, height);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header().map_err(enc_err)?;
    writer.write_image_data(pixels).map_err(enc_err)?;
    writer.finish().map_err(enc_err)?;
    std::fs::write(path, &bytes).map_err(|source| ChartError::Io {
        path: path.to_path_buf(),
        source,
    })
}

#[cfg(test)]
#[path = "chart_tests.rs"]
mod tests;
