//! The training-curves PNG: loss and NE on the left, AUC on the right (plotters, with the
//! DejaVu Sans font embedded so no system font library is needed).

use std::path::Path;

use embers::Result;
use plotters::prelude::*;

#[path = "../shared/chart.rs"]
mod chart;
use chart::{panel, save_png, DrawResult};

/// Curves to draw, as (step, value) points.
pub struct Series {
    pub train_loss: Vec<(f64, f64)>,
    pub train_ne: Vec<(f64, f64)>,
    pub train_auc: Vec<(f64, f64)>,
    pub val_ne: Vec<(f64, f64)>,
    pub val_auc: Vec<(f64, f64)>,
}

fn draw(
    root: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>,
    s: &Series,
    best_auc: Option<f64>,
) -> DrawResult<()> {
    let (left, right) = root.split_horizontally(600);
    panel(
        &left,
        "loss and normalized entropy",
        "step",
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
        "step",
        &[
            (&s.train_auc, RED, "train AUC (window)"),
            (&s.val_auc, BLACK, "validation AUC"),
        ],
        best_auc.map(|b| (b, "best achievable (validation)")),
        SeriesLabelPosition::LowerRight,
    )?;
    Ok(())
}

/// Draws the curves to `path` (PNG, written to a temporary file and renamed into place).
pub fn training_curves(path: &Path, s: &Series, best_auc: Option<f64>) -> Result<()> {
    save_png(path, (1200, 480), |root| draw(root, s, best_auc))
}
