//! The tie-correct ROC AUC of a scored dataset (its best achievable AUC): embers' metric
//! ([`embers::metrics::auc::auc_tie_correct`]), undefined cases reported as `None`.

use embers::metrics::auc::{auc_tie_correct, Sample};

/// Area under the ROC curve of `scores` against binary `labels` (a label > 0.5 is positive).
///
/// Tied scores count half (each tie group is one step of the curve), so a constant predictor
/// scores exactly 0.5. Returns `None` when the lengths differ, a score is NaN, or either class
/// is absent (AUC undefined).
pub fn tie_corrected_auc(scores: &[f32], labels: &[f32]) -> Option<f64> {
    if scores.len() != labels.len() || scores.iter().any(|s| s.is_nan()) {
        return None;
    }
    let positives = labels.iter().filter(|&&l| l > 0.5).count();
    if positives == 0 || positives == labels.len() {
        return None;
    }
    let samples: Vec<Sample> = (scores.iter().zip(labels))
        .map(|(&prediction, &label)| Sample {
            prediction,
            label: if label > 0.5 { 1.0 } else { 0.0 },
            weight: 1.0,
        })
        .collect();
    Some(auc_tie_correct(&samples))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn perfect_inverse_and_constant() {
        let labels = [0.0, 0.0, 1.0, 1.0];
        assert_eq!(tie_corrected_auc(&[0.1, 0.2, 0.3, 0.4], &labels), Some(1.0));
        assert_eq!(tie_corrected_auc(&[0.4, 0.3, 0.2, 0.1], &labels), Some(0.0));
        assert_eq!(tie_corrected_auc(&[0.5; 4], &labels), Some(0.5));
    }

    #[test]
    fn ties_count_half_against_brute_force() {
        let scores = [0.1, 0.5, 0.5, 0.3, 0.5, 0.9, 0.3];
        let labels = [0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0];
        let mut wins = 0.0;
        let mut pairs = 0.0;
        for (i, &li) in labels.iter().enumerate() {
            for (j, &lj) in labels.iter().enumerate() {
                if li > 0.5 && lj < 0.5 {
                    pairs += 1.0;
                    wins += if scores[i] > scores[j] {
                        1.0
                    } else if scores[i] == scores[j] {
                        0.5
                    } else {
                        0.0
                    };
                }
            }
        }
        let auc = tie_corrected_auc(&scores, &labels).unwrap();
        assert!(
            (auc - wins / pairs).abs() < 1e-12,
            "{auc} vs {}",
            wins / pairs
        );
    }

    #[test]
    fn undefined_cases_are_none() {
        assert_eq!(tie_corrected_auc(&[0.1, 0.2], &[1.0, 1.0]), None);
        assert_eq!(tie_corrected_auc(&[0.1], &[1.0, 0.0]), None);
        assert_eq!(tie_corrected_auc(&[f32::NAN, 0.2], &[1.0, 0.0]), None);
    }
}
