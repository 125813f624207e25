//! PNG line plots with plotters. Text needs a TrueType font, found at run time.

use std::path::Path;
use std::sync::OnceLock;

use anyhow::anyhow;
use plotters::prelude::*;

/// Font files tried in order after `$COPUS_FONT`.
const FONT_PATHS: [&str; 6] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/System/Library/Fonts/Supplemental/Arial.ttf",
    "C:\\Windows\\Fonts\\arial.ttf",
];

/// Registers a font once; `Err` says how to get one.
pub fn ensure_font() -> anyhow::Result<()> {
    static FONT: OnceLock<Result<(), String>> = OnceLock::new();
    FONT.get_or_init(|| {
        let candidates = std::env::var("COPUS_FONT").into_iter().chain(FONT_PATHS.iter().map(|s| s.to_string()));
        for path in candidates {
            if let Ok(bytes) = std::fs::read(&path) {
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                    return Ok(());
                }
            }
        }
        Err("no TrueType font found for plot text; install one (`apt-get install fonts-dejavu-core`) or set COPUS_FONT to a .ttf file"
            .to_string())
    })
    .clone()
    .map_err(anyhow::Error::msg)
}

/// One line of a plot.
pub struct Series<'a> {
    /// Legend label.
    pub label: &'a str,
    /// Points (x, y).
    pub points: Vec<(f64, f64)>,
}

fn bounds(series: &[Series<'_>], log_y: bool) -> Option<((f64, f64), (f64, f64))> {
    let pts = series.iter().flat_map(|s| s.points.iter()).filter(|p| p.0.is_finite() && p.1.is_finite() && (!log_y || p.1 > 0.0));
    let (mut x0, mut x1, mut y0, mut y1) = (f64::INFINITY, f64::NEG_INFINITY, f64::INFINITY, f64::NEG_INFINITY);
    for &(x, y) in pts {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if !x0.is_finite() {
        return None;
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    if y1 <= y0 {
        y1 = y0 + y0.abs().max(1.0) * 0.1;
    }
    let pad = if log_y { 0.0 } else { 0.05 * (y1 - y0) };
    Some(((x0, x1), (y0 - pad, y1 + pad)))
}

/// One colour per series, ten apart before they repeat (a headline plots eight arms).
const SERIES_COLORS: [RGBColor; 10] = [
    BLUE,
    RED,
    RGBColor(0, 160, 0),
    MAGENTA,
    RGBColor(0, 190, 190),
    BLACK,
    RGBColor(255, 140, 0),
    RGBColor(140, 80, 20),
    RGBColor(128, 128, 128),
    RGBColor(110, 0, 170),
];

/// Draws `series` as lines into a PNG at `path`. `log_y` uses a log scale for y.
pub fn line_plot(path: &Path, title: &str, x_label: &str, y_label: &str, series: &[Series<'_>], log_y: bool) -> anyhow::Result<()> {
    ensure_font()?;
    let Some(((x0, x1), (y0, y1))) = bounds(series, log_y) else {
        return Err(anyhow!("{}: nothing to plot", path.display()));
    };
    let root = BitMapBackend::new(path, (900, 560)).into_drawing_area();
    let err = |e: &dyn std::fmt::Display| anyhow!("{}: {e}", path.display());
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let colors = SERIES_COLORS;
    macro_rules! draw {
        ($chart:expr) => {{
            let mut chart = $chart;
            chart.configure_mesh().x_desc(x_label).y_desc(y_label).draw().map_err(|e| err(&e))?;
            for (i, s) in series.iter().enumerate() {
                let c = colors[i % colors.len()];
                chart
                    .draw_series(LineSeries::new(s.points.iter().copied().filter(|p| !log_y || p.1 > 0.0), c.stroke_width(2)))
                    .map_err(|e| err(&e))?
                    .label(s.label)
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
            }
            chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw().map_err(|e| err(&e))?;
        }};
    }
    let mut builder = ChartBuilder::on(&root);
    builder.caption(title, ("sans-serif", 22)).margin(12).x_label_area_size(44).y_label_area_size(70);
    if log_y {
        draw!(builder.build_cartesian_2d(x0..x1, (y0..y1).log_scale()).map_err(|e| err(&e))?);
    } else {
        draw!(builder.build_cartesian_2d(x0..x1, y0..y1).map_err(|e| err(&e))?);
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

/// Like [`line_plot`], with shaded x-ranges `(start, end, label)` (one colour per label) behind
/// the lines, e.g. the layout a run used over time.
pub fn region_plot(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series<'_>],
    regions: &[(f64, f64, String)],
    markers: &[f64],
) -> anyhow::Result<()> {
    ensure_font()?;
    let Some(((x0, x1), (y0, y1))) = bounds(series, false) else {
        return Err(anyhow!("{}: nothing to plot", path.display()));
    };
    let root = BitMapBackend::new(path, (900, 560)).into_drawing_area();
    let err = |e: &dyn std::fmt::Display| anyhow!("{}: {e}", path.display());
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(70)
        .build_cartesian_2d(x0..x1, y0..y1)
        .map_err(|e| err(&e))?;
    chart.configure_mesh().x_desc(x_label).y_desc(y_label).draw().map_err(|e| err(&e))?;
    let shades = [
        RGBColor(255, 228, 196),
        RGBColor(204, 229, 255),
        RGBColor(214, 245, 214),
        RGBColor(240, 220, 245),
        RGBColor(255, 250, 205),
        RGBColor(230, 230, 230),
    ];
    let mut labels: Vec<&str> = Vec::new();
    for (a, b, label) in regions {
        let k = labels.iter().position(|l| *l == label.as_str()).unwrap_or_else(|| {
            labels.push(label);
            labels.len() - 1
        });
        let c = shades[k % shades.len()];
        let first = labels.iter().filter(|l| **l == label.as_str()).count() == 1
            && regions.iter().position(|r| &r.2 == label) == regions.iter().position(|r| r.0 == *a && r.1 == *b);
        let drawn = chart.draw_series(std::iter::once(Rectangle::new([(*a, y0), (*b, y1)], c.filled()))).map_err(|e| err(&e))?;
        if first {
            drawn.label(label.clone()).legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 20, y + 5)], c.filled()));
        }
    }
    for (k, &x) in markers.iter().enumerate() {
        let drawn = chart
            .draw_series(std::iter::once(PathElement::new(vec![(x, y0), (x, y1)], BLACK.mix(0.6).stroke_width(1))))
            .map_err(|e| err(&e))?;
        if k == 0 {
            drawn
                .label("batch change")
                .legend(|(x, y)| PathElement::new(vec![(x + 10, y - 6), (x + 10, y + 6)], BLACK.mix(0.6).stroke_width(1)));
        }
    }
    let colors = SERIES_COLORS;
    for (i, s) in series.iter().enumerate() {
        let c = colors[i % colors.len()];
        chart
            .draw_series(LineSeries::new(s.points.iter().copied(), c.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label(s.label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
    }
    chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw().map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}
