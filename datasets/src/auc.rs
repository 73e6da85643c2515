//! Tie-correct ROC AUC (Mann–Whitney U with average ranks for tied scores).

/// Area under the ROC curve of `scores` against binary `labels` (a label > 0.5 is positive).
///
/// Tied scores get their average rank, so a constant predictor scores exactly 0.5. Returns
/// `None` when the lengths differ, a score is NaN, or either class is absent (AUC undefined).
pub fn tie_corrected_auc(scores: &[f32], labels: &[f32]) -> Option<f64> {
    if scores.len() != labels.len() || scores.iter().any(|s| s.is_nan()) {
        return None;
    }
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_unstable_by(|&a, &b| scores[a].total_cmp(&scores[b]));
    let positives = labels.iter().filter(|&&l| l > 0.5).count();
    let negatives = labels.len() - positives;
    if positives == 0 || negatives == 0 {
        return None;
    }
    let mut positive_rank_sum = 0f64;
    let mut start = 0;
    while start < order.len() {
        let mut end = start + 1;
        while end < order.len() && scores[order[end]] == scores[order[start]] {
            end += 1;
        }
        // Ranks are 1-based; the tie group [start, end) shares the mean of ranks start+1..=end.
        let average_rank = (start + end + 1) as f64 / 2.0;
        let group_positives = order[start..end]
            .iter()
            .filter(|&&i| labels[i] > 0.5)
            .count();
        positive_rank_sum += average_rank * group_positives as f64;
        start = end;
    }
    let p = positives as f64;
    let u = positive_rank_sum - p * (p + 1.0) / 2.0;
    Some(u / (p * negatives as f64))
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
