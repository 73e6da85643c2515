//! Line charts for the examples' PNG reports (plotters, with the DejaVu Sans font embedded so
//! no system font library is needed): one panel of curves, and an atomic PNG write.

use std::path::Path;

use embers::{Error, Result};
use plotters::prelude::*;
use plotters::style::FontStyle;

/// Points, colour and legend label of one line.
pub type Curve<'a> = (&'a [(f64, f64)], RGBColor, &'a str);

fn range(curves: &[&[(f64, f64)]], extra: Option<f64>) -> ((f64, f64), (f64, f64)) {
    let points = curves.iter().flat_map(|c| c.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in points {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if let Some(e) = extra {
        y0 = y0.min(e);
        y1 = y1.max(e);
    }
    if x0 > x1 {
        return ((0.0, 1.0), (0.0, 1.0));
    }
    let pad = ((y1 - y0) * 0.05).max(1e-3);
    ((x0.min(x1 - 1.0), x1), (y0 - pad, y1 + pad))
}

pub type DrawResult<T> = std::result::Result<T, String>;

pub fn err(x: impl std::fmt::Display) -> String {
    x.to_string()
}

/// One chart: `curves` against `x_desc` (the step, the epoch), plus an optional horizontal
/// reference line.
pub fn panel(
    area: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>,
    caption: &str,
    x_desc: &str,
    curves: &[Curve],
    reference: Option<(f64, &str)>,
    legend: SeriesLabelPosition,
) -> DrawResult<()> {
    let all: Vec<&[(f64, f64)]> = curves.iter().map(|c| c.0).collect();
    let ((x0, x1), (y0, y1)) = range(&all, reference.map(|r| r.0));
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d(x0..x1, y0..y1)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .draw()
        .map_err(err)?;
    let green = RGBColor(0, 140, 0);
    let reference_curve = reference.map(|(y, label)| ([(x0, y), (x1, y)], green, label));
    let lines = curves
        .iter()
        .map(|&(points, color, label)| (points, color, label))
        .chain(reference_curve.iter().map(|(p, c, l)| (&p[..], *c, *l)));
    for (points, color, label) in lines {
        chart
            .draw_series(LineSeries::new(points.iter().copied(), color))
            .map_err(err)?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color));
    }
    chart
        .configure_series_labels()
        .position(legend)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    Ok(())
}

/// Draws a `width × height` PNG at `path` with `draw` (written to a temporary file and renamed
/// into place).
pub fn save_png(
    path: &Path,
    (width, height): (u32, u32),
    draw: impl FnOnce(&DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>) -> DrawResult<()>,
) -> Result<()> {
    let tmp = path.with_extension("tmp.png");
    let drawn = (|| {
        // Registering twice is harmless; the font is only needed once per process.
        let _ = plotters::style::register_font(
            "sans-serif",
            FontStyle::Normal,
            dejavu::sans::regular(),
        );
        let root = BitMapBackend::new(&tmp, (width, height)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        draw(&root)?;
        root.present().map_err(err)
    })();
    drawn.map_err(|m| Error::invalid("plot", format!("{}: {m}", path.display())))?;
    std::fs::rename(&tmp, path).map_err(|source| Error::Io {
        path: path.display().to_string(),
        source,
    })
}
