//! The TwoTower report's PNG: the training loss per step on the left, retrieval quality on the
//! held-out interactions per epoch on the right (Recall@10/50/100 of exact search, with the
//! popularity baseline's Recall@100 as a reference line).

use std::path::Path;

use embers::Result;
use plotters::prelude::*;

#[path = "../shared/chart.rs"]
mod chart;
use chart::{panel, save_png};

/// Curves to draw.
pub struct Series {
    /// (step, mean loss since the previous point).
    pub loss: Vec<(f64, f64)>,
    /// (epoch, value) of Recall@10, @50, @100.
    pub recall: [Vec<(f64, f64)>; 3],
    /// The popularity baseline's Recall@100.
    pub popularity_at_100: f64,
}

/// Draws `s` to `path` (atomically).
pub fn curves(path: &Path, s: &Series) -> Result<()> {
    save_png(path, (1200, 480), |root| {
        let (left, right) = root.split_horizontally(600);
        panel(
            &left,
            "training loss",
            "step",
            &[(&s.loss, BLUE, "loss (mean since last point)")],
            None,
            SeriesLabelPosition::UpperRight,
        )?;
        let magenta = RGBColor(170, 0, 170);
        panel(
            &right,
            "held-out recall (exact search, seen items excluded)",
            "epoch",
            &[
                (&s.recall[2], BLACK, "Recall@100"),
                (&s.recall[1], magenta, "Recall@50"),
                (&s.recall[0], RED, "Recall@10"),
            ],
            Some((s.popularity_at_100, "popularity Recall@100")),
            SeriesLabelPosition::LowerRight,
        )
    })
}
