//! The training-curves PNG: loss and NE on the left, AUC on the right (plotters, with the
//! DejaVu Sans font embedded so no system font library is needed).

use std::path::Path;

use embers::{Error, Result};
use plotters::prelude::*;
use plotters::style::FontStyle;

/// Curves to draw, as (step, value) points.
pub struct Series {
    pub train_loss: Vec<(f64, f64)>,
    pub train_ne: Vec<(f64, f64)>,
    pub train_auc: Vec<(f64, f64)>,
    pub val_ne: Vec<(f64, f64)>,
    pub val_auc: Vec<(f64, f64)>,
}

/// Points, colour and legend label of one line.
type Curve<'a> = (&'a [(f64, f64)], RGBColor, &'a str);

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

type DrawResult<T> = std::result::Result<T, String>;

fn err(x: impl std::fmt::Display) -> String {
    x.to_string()
}

/// One chart: `curves` against the step, plus an optional horizontal reference line.
fn panel(
    area: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>,
    caption: &str,
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
        .x_desc("step")
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

fn draw(path: &Path, s: &Series, best_auc: Option<f64>) -> DrawResult<()> {
    // Registering twice is harmless; the font is only needed once per process.
    let _ =
        plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular());
    let root = BitMapBackend::new(path, (1200, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let (left, right) = root.split_horizontally(600);
    panel(
        &left,
        "loss and normalized entropy",
        &[
            (&s.train_loss, BLUE, "train loss (mean since last point)"),
            (&s.train_ne, RED, "train NE (window)"),
            (&s.val_ne, BLACK, "validation NE"),
        ],
        None,
        SeriesLabelPosition::UpperRight,
    )?;
    panel(
        &right,
        "AUC",
        &[
            (&s.train_auc, RED, "train AUC (window)"),
            (&s.val_auc, BLACK, "validation AUC"),
        ],
        best_auc.map(|b| (b, "best achievable (validation)")),
        SeriesLabelPosition::LowerRight,
    )?;
    root.present().map_err(err)?;
    Ok(())
}

/// Draws the curves to `path` (PNG, written to a temporary file and renamed into place).
pub fn training_curves(path: &Path, s: &Series, best_auc: Option<f64>) -> Result<()> {
    let tmp = path.with_extension("tmp.png");
    draw(&tmp, s, best_auc)
        .map_err(|m| Error::invalid("plot", format!("{}: {m}", path.display())))?;
    std::fs::rename(&tmp, path).map_err(|source| Error::Io {
        path: path.display().to_string(),
        source,
    })
}
