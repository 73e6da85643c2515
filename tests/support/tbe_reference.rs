//! A float64 re-implementation of the TBE forward and fused backward, used as the oracle where
//! FBGEMM's CPU build cannot produce a value (Adam, odd dims) or produces a wrong one (MEAN with
//! per-sample weights, shared tables, weight decay). With `fbgemm_cpu_quirks` it reproduces
//! FBGEMM's CPU behaviour instead, which the golden tests use to check this oracle itself.
#![allow(dead_code)]
// Index loops mirror the update formulas one to one; iterator chains would obscure them.
#![allow(clippy::needless_range_loop)]

use std::collections::BTreeMap;

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RefPooling {
    Sum,
    Mean,
    None,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RefOptimizer {
    None,
    Sgd {
        lr: f64,
    },
    Adagrad {
        lr: f64,
        eps: f64,
    },
    RowWiseAdagrad {
        lr: f64,
        eps: f64,
    },
    Adam {
        lr: f64,
        beta1: f64,
        beta2: f64,
        eps: f64,
    },
    /// Adam with one second moment per row: the mean of g² over the row.
    PartialRowWiseAdam {
        lr: f64,
        beta1: f64,
        beta2: f64,
        eps: f64,
    },
    /// LAMB with per-row norms: w -= lr · (‖w‖/‖r‖) · r, r Adam's direction (+ λw decoupled).
    Lamb {
        lr: f64,
        beta1: f64,
        beta2: f64,
        eps: f64,
    },
    /// LAMB with partial row-wise Adam's per-row second moment.
    PartialRowWiseLamb {
        lr: f64,
        beta1: f64,
        beta2: f64,
        eps: f64,
    },
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RefDecay {
    None,
    L2(f64),
    Decoupled(f64),
}

pub struct RefTbe {
    pub tables: Vec<(usize, usize)>,
    pub feature_table_map: Vec<usize>,
    pub pooling: RefPooling,
    pub optimizer: RefOptimizer,
    pub decay: RefDecay,
    pub weights: Vec<Vec<f64>>,
    /// Per table: per-row (row-wise Adagrad) or per-element state.
    pub m1: Vec<Vec<f64>>,
    pub m2: Vec<Vec<f64>>,
    pub step: u64,
    pub fbgemm_cpu_quirks: bool,
    /// Row-sparse gradients of the last backward with `RefOptimizer::None`: per table, row → g.
    pub last_sparse: Vec<BTreeMap<usize, Vec<f64>>>,
}

impl RefTbe {
    pub fn new(
        tables: Vec<(usize, usize)>,
        feature_table_map: Vec<usize>,
        pooling: RefPooling,
        optimizer: RefOptimizer,
        decay: RefDecay,
        weights: Vec<Vec<f64>>,
    ) -> Self {
        let m1 = tables
            .iter()
            .map(|&(r, d)| match optimizer {
                RefOptimizer::RowWiseAdagrad { .. } => vec![0.0; r],
                RefOptimizer::Adagrad { .. }
                | RefOptimizer::Adam { .. }
                | RefOptimizer::PartialRowWiseAdam { .. }
                | RefOptimizer::Lamb { .. }
                | RefOptimizer::PartialRowWiseLamb { .. } => vec![0.0; r * d],
                _ => vec![],
            })
            .collect();
        let m2 = tables
            .iter()
            .map(|&(r, d)| match optimizer {
                RefOptimizer::Adam { .. } | RefOptimizer::Lamb { .. } => vec![0.0; r * d],
                RefOptimizer::PartialRowWiseAdam { .. }
                | RefOptimizer::PartialRowWiseLamb { .. } => vec![0.0; r],
                _ => vec![],
            })
            .collect();
        RefTbe {
            last_sparse: vec![BTreeMap::new(); tables.len()],
            tables,
            feature_table_map,
            pooling,
            optimizer,
            decay,
            weights,
            m1,
            m2,
            step: 0,
            fbgemm_cpu_quirks: false,
        }
    }

    fn dims(&self) -> Vec<usize> {
        self.feature_table_map
            .iter()
            .map(|&t| self.tables[t].1)
            .collect()
    }

    pub fn out_width(&self) -> usize {
        let dims = self.dims();
        if self.pooling == RefPooling::None {
            dims[0]
        } else {
            dims.iter().sum()
        }
    }

    fn col(&self, f: usize) -> usize {
        self.dims()[..f].iter().sum()
    }

    pub fn forward(&self, indices: &[i64], offsets: &[i64], psw: Option<&[f64]>) -> Vec<f64> {
        let nf = self.feature_table_map.len();
        let b_total = (offsets.len() - 1) / nf;
        let width = self.out_width();
        let rows_out = if self.pooling == RefPooling::None {
            indices.len()
        } else {
            b_total
        };
        let mut out = vec![0.0; rows_out * width];
        for f in 0..nf {
            let t = self.feature_table_map[f];
            let d = self.tables[t].1;
            let col = self.col(f);
            for b in 0..b_total {
                let (s, e) = (
                    offsets[f * b_total + b] as usize,
                    offsets[f * b_total + b + 1] as usize,
                );
                for p in s..e {
                    let id = indices[p] as usize;
                    let w = psw.map_or(1.0, |w| w[p]);
                    let scale = match self.pooling {
                        RefPooling::Mean => w / (e - s) as f64,
                        _ => w,
                    };
                    for j in 0..d {
                        let o = match self.pooling {
                            RefPooling::None => p * width + j,
                            _ => b * width + col + j,
                        };
                        out[o] += scale * self.weights[t][id * d + j];
                    }
                }
            }
        }
        out
    }

    /// Backward + fused step; returns the per-sample-weight gradient when weights were given.
    pub fn backward(
        &mut self,
        indices: &[i64],
        offsets: &[i64],
        psw: Option<&[f64]>,
        grad_out: &[f64],
    ) -> Option<Vec<f64>> {
        self.step += 1;
        let nf = self.feature_table_map.len();
        let b_total = (offsets.len() - 1) / nf;
        let width = self.out_width();
        let old = self.weights.clone();
        let mut psw_grad = psw.map(|_| vec![0.0; indices.len()]);
        // Per (table, group) the summed row gradients; a group is the whole table, or one
        // feature when reproducing FBGEMM's CPU per-feature stepping.
        let mut groups: Vec<(usize, BTreeMap<usize, Vec<f64>>)> = Vec::new();
        for t in 0..self.tables.len() {
            let feats: Vec<usize> = (0..nf)
                .filter(|&f| self.feature_table_map[f] == t)
                .collect();
            let feature_groups: Vec<Vec<usize>> = if self.fbgemm_cpu_quirks {
                feats.iter().map(|&f| vec![f]).collect()
            } else {
                vec![feats]
            };
            for fs in feature_groups {
                let d = self.tables[t].1;
                let mut g: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
                for &f in &fs {
                    let col = self.col(f);
                    for b in 0..b_total {
                        let (s, e) = (
                            offsets[f * b_total + b] as usize,
                            offsets[f * b_total + b + 1] as usize,
                        );
                        for p in s..e {
                            let id = indices[p] as usize;
                            let w = psw.map_or(1.0, |w| w[p]);
                            let inv_len = match self.pooling {
                                RefPooling::Mean if !(self.fbgemm_cpu_quirks && psw.is_some()) => {
                                    1.0 / (e - s) as f64
                                }
                                _ => 1.0,
                            };
                            let entry = g.entry(id).or_insert_with(|| vec![0.0; d]);
                            let mut dot = 0.0;
                            for j in 0..d {
                                let go = match self.pooling {
                                    RefPooling::None => grad_out[p * width + j],
                                    _ => grad_out[b * width + col + j],
                                };
                                entry[j] += w * inv_len * go;
                                dot += old[t][id * d + j] * go;
                            }
                            if let Some(pg) = psw_grad.as_mut() {
                                pg[p] = dot * inv_len;
                            }
                        }
                    }
                }
                groups.push((t, g));
            }
        }
        if self.optimizer == RefOptimizer::None {
            self.last_sparse = vec![BTreeMap::new(); self.tables.len()];
        }
        for (t, g) in groups {
            let d = self.tables[t].1;
            for (id, mut grad) in g {
                if self.optimizer == RefOptimizer::None {
                    let e = self.last_sparse[t]
                        .entry(id)
                        .or_insert_with(|| vec![0.0; d]);
                    for j in 0..d {
                        e[j] += grad[j];
                    }
                    continue;
                }
                let decay = if self.fbgemm_cpu_quirks {
                    RefDecay::None
                } else {
                    self.decay
                };
                let w = &mut self.weights[t][id * d..(id + 1) * d];
                if let RefDecay::L2(l) = decay {
                    for j in 0..d {
                        grad[j] += l * w[j];
                    }
                }
                let lamb = matches!(
                    self.optimizer,
                    RefOptimizer::Lamb { .. } | RefOptimizer::PartialRowWiseLamb { .. }
                );
                let decoupled = |lr: f64| match decay {
                    RefDecay::Decoupled(l) if !lamb => lr * l,
                    _ => 0.0,
                };
                match self.optimizer {
                    RefOptimizer::None => unreachable!(),
                    RefOptimizer::Sgd { lr } => {
                        for j in 0..d {
                            w[j] -= lr * grad[j] + decoupled(lr) * w[j];
                        }
                    }
                    RefOptimizer::Adagrad { lr, eps } => {
                        let m = &mut self.m1[t][id * d..(id + 1) * d];
                        for j in 0..d {
                            m[j] += grad[j] * grad[j];
                            w[j] -= lr * grad[j] / (m[j].sqrt() + eps) + decoupled(lr) * w[j];
                        }
                    }
                    RefOptimizer::RowWiseAdagrad { lr, eps } => {
                        let ms: f64 = grad.iter().map(|g| g * g).sum::<f64>() / d as f64;
                        self.m1[t][id] += ms;
                        let m = self.m1[t][id];
                        for j in 0..d {
                            w[j] -= lr * grad[j] / (m.sqrt() + eps) + decoupled(lr) * w[j];
                        }
                    }
                    RefOptimizer::Adam {
                        lr,
                        beta1,
                        beta2,
                        eps,
                    } => {
                        let t_step = self.step as i32;
                        let (c1, c2) = (1.0 - beta1.powi(t_step), 1.0 - beta2.powi(t_step));
                        for j in 0..d {
                            let m = &mut self.m1[t][id * d + j];
                            *m = beta1 * *m + (1.0 - beta1) * grad[j];
                            let mh = *m / c1;
                            let v = &mut self.m2[t][id * d + j];
                            *v = beta2 * *v + (1.0 - beta2) * grad[j] * grad[j];
                            let vh = *v / c2;
                            w[j] -= lr * mh / (vh.sqrt() + eps) + decoupled(lr) * w[j];
                        }
                    }
                    RefOptimizer::PartialRowWiseAdam {
                        lr,
                        beta1,
                        beta2,
                        eps,
                    }
                    | RefOptimizer::Lamb {
                        lr,
                        beta1,
                        beta2,
                        eps,
                    }
                    | RefOptimizer::PartialRowWiseLamb {
                        lr,
                        beta1,
                        beta2,
                        eps,
                    } => {
                        let t_step = self.step as i32;
                        let (c1, c2) = (1.0 - beta1.powi(t_step), 1.0 - beta2.powi(t_step));
                        let per_row = !matches!(self.optimizer, RefOptimizer::Lamb { .. });
                        if per_row {
                            let ms = grad.iter().map(|g| g * g).sum::<f64>() / d as f64;
                            let v = &mut self.m2[t][id];
                            *v = beta2 * *v + (1.0 - beta2) * ms;
                        }
                        // Adam's direction per element.
                        let mut r = vec![0.0; d];
                        for j in 0..d {
                            let m = &mut self.m1[t][id * d + j];
                            *m = beta1 * *m + (1.0 - beta1) * grad[j];
                            let v = if per_row {
                                self.m2[t][id]
                            } else {
                                let v = &mut self.m2[t][id * d + j];
                                *v = beta2 * *v + (1.0 - beta2) * grad[j] * grad[j];
                                *v
                            };
                            r[j] = (*m / c1) / ((v / c2).sqrt() + eps);
                        }
                        if lamb {
                            let lambda = match decay {
                                RefDecay::Decoupled(l) => l,
                                _ => 0.0,
                            };
                            for j in 0..d {
                                r[j] += lambda * w[j];
                            }
                            let norm = |x: &[f64]| x.iter().map(|v| v * v).sum::<f64>().sqrt();
                            let (wn, rn) = (norm(w), norm(&r));
                            let ratio = if wn > 0.0 && rn > 0.0 { wn / rn } else { 1.0 };
                            for j in 0..d {
                                w[j] -= lr * ratio * r[j];
                            }
                        } else {
                            for j in 0..d {
                                w[j] -= lr * r[j] + decoupled(lr) * w[j];
                            }
                        }
                    }
                }
            }
        }
        psw_grad
    }
}

/// `|a − e| ≤ atol + rtol·|e|` everywhere, with a message naming `what` and the element.
pub fn assert_close(actual: &[f64], expected: &[f64], rtol: f64, atol: f64, what: &str) {
    assert_eq!(
        actual.len(),
        expected.len(),
        "{what}: length {} vs expected {}",
        actual.len(),
        expected.len()
    );
    for (i, (a, e)) in actual.iter().zip(expected).enumerate() {
        assert!(
            (a - e).abs() <= atol + rtol * e.abs(),
            "{what}[{i}]: got {a}, expected {e} (|diff| {})",
            (a - e).abs()
        );
    }
}
