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

fn draw(path: &Path, s: &Series, best_auc: Option<f64>) -> std::result::Result<(), String> {
    let e = |x: &dyn std::fmt::Display| x.to_string();
    // Registering twice is harmless; the font is only needed once per process.
    let _ =
        plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular());
    let root = BitMapBackend::new(path, (1200, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let (left, right) = root.split_horizontally(600);

    let ((x0, x1), (y0, y1)) = range(&[&s.train_loss, &s.train_ne, &s.val_ne], None);
    let mut chart = ChartBuilder::on(&left)
        .caption("loss and normalized entropy", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d(x0..x1, y0..y1)
        .map_err(|x| e(&x))?;
    chart
        .configure_mesh()
        .x_desc("step")
        .draw()
        .map_err(|x| e(&x))?;
    let curves: [Curve; 3] = [
        (&s.train_loss, BLUE, "train loss (mean since last point)"),
        (&s.train_ne, RED, "train NE (window)"),
        (&s.val_ne, BLACK, "validation NE"),
    ];
    for (points, color, label) in curves {
        chart
            .draw_series(LineSeries::new(points.iter().copied(), color))
            .map_err(|x| e(&x))?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|x| e(&x))?;

    let ((x0, x1), (y0, y1)) = range(&[&s.train_auc, &s.val_auc], best_auc);
    let mut chart = ChartBuilder::on(&right)
        .caption("AUC", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d(x0..x1, y0..y1)
        .map_err(|x| e(&x))?;
    chart
        .configure_mesh()
        .x_desc("step")
        .draw()
        .map_err(|x| e(&x))?;
    let curves: [Curve; 2] = [
        (&s.train_auc, RED, "train AUC (window)"),
        (&s.val_auc, BLACK, "validation AUC"),
    ];
    for (points, color, label) in curves {
        chart
            .draw_series(LineSeries::new(points.iter().copied(), color))
            .map_err(|x| e(&x))?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color));
    }
    if let Some(b) = best_auc {
        let green = RGBColor(0, 140, 0);
        chart
            .draw_series(LineSeries::new([(x0, b), (x1, b)], green))
            .map_err(|x| e(&x))?
            .label("best achievable (validation)")
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], green));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|x| e(&x))?;
    root.present().map_err(|x| e(&x))?;
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
