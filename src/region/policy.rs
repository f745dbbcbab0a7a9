//! How the global capacity is divided: static weights, or by demand (fair share or
//! proportional share). Pure integer math; the home script (`lua/region_home.lua`) runs the
//! same steps, and `tests/region/model.rs` checks the two agree.

use std::fmt;

/// How a [`QuotaAllocator`](crate::region::QuotaAllocator) divides the global capacity among
/// its regions.
///
/// Every policy first sets aside each region's safe share (see
/// [`SafeShare`](crate::region::SafeShare)) and divides what is left; a region's target is its
/// safe share plus its part of the rest. All arithmetic is on whole units of the global
/// quota's period (a quota of 300 per second is divided in requests per second), so the
/// targets never add up to more than the capacity; a split by weight or by want rounds each
/// part down and gives the units left one each to the largest remainders (ties to the first
/// listed): 1 per second over three equal weights is 1 / 0 / 0.
///
/// The demand-driven policies are the two algorithms of Doorman (YouTube's global rate
/// limiter): a region's *want* is its measured demand (what it admitted plus what it
/// rejected, smoothed) plus an eighth for headroom.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Allocation {
    /// Each region gets the capacity in proportion to its weight, whatever its demand (the
    /// "50 % US, 30 % EU, 20 % AP" split). Quota a region does not use is lost.
    Static,
    /// Max-min fairness: every region gets what it wants if that is at most an equal share;
    /// the capacity the modest regions leave is shared equally by the others. Capacity 120,
    /// wants 1000 / 50 / 10 → 60 / 50 / 10.
    #[default]
    FairShare,
    /// Everyone gets what it wants if the wants fit; otherwise each region gets the capacity
    /// in proportion to its want. Capacity 120, wants 1000 / 50 / 10 → 113 / 6 / 1.
    ProportionalShare,
}

impl Allocation {
    /// The number the home script knows this policy by.
    pub(crate) fn code(self) -> u8 {
        match self {
            Allocation::Static => 0,
            Allocation::FairShare => 1,
            Allocation::ProportionalShare => 2,
        }
    }

    /// Divide `capacity` among regions with these `weights` (used by [`Static`]) and
    /// `wants` (used by the demand-driven policies); both slices have one entry per region.
    /// The result never adds up to more than `capacity`.
    ///
    /// [`Static`]: Allocation::Static
    ///
    /// # Examples
    ///
    /// ```
    /// use flowgate::region::Allocation;
    ///
    /// let fair = Allocation::FairShare.divide(120, &[1, 1, 1], &[1000, 50, 10]);
    /// assert_eq!(fair, [60, 50, 10]);
    /// let split = Allocation::Static.divide(100, &[50, 30, 20], &[0, 0, 0]);
    /// assert_eq!(split, [50, 30, 20]);
    /// ```
    pub fn divide(self, capacity: u64, weights: &[u64], wants: &[u64]) -> Vec<u64> {
        match self {
            Allocation::Static => by_weight(capacity, weights),
            Allocation::FairShare => fair_share(capacity, wants),
            Allocation::ProportionalShare => {
                let total: u128 = wants.iter().map(|&w| u128::from(w)).sum();
                if total <= u128::from(capacity) {
                    wants.to_vec()
                } else {
                    by_weight(capacity, wants)
                }
            }
        }
    }
}

impl fmt::Display for Allocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Allocation::Static => "static",
            Allocation::FairShare => "fair share",
            Allocation::ProportionalShare => "proportional share",
        })
    }
}

/// `capacity` in proportion to `weights`, each part rounded down, then the units the
/// rounding left one each to the largest remainders (ties to the first listed): the parts
/// add up to the whole capacity (all zero weights: nothing). Rounded down alone, a capacity
/// below the number of regions was lost whole (1 over three equal weights: 0 / 0 / 0).
fn by_weight(capacity: u64, weights: &[u64]) -> Vec<u64> {
    let total: u128 = weights.iter().map(|&w| u128::from(w)).sum();
    if total == 0 {
        return vec![0; weights.len()];
    }
    // capacity * w / total <= capacity: fits in a u64; the remainders are below `total`.
    let (mut parts, rems): (Vec<u64>, Vec<u128>) = weights
        .iter()
        .map(|&w| {
            let share = u128::from(capacity) * u128::from(w);
            (u64::try_from(share / total).unwrap_or(0), share % total)
        })
        .unzip();
    // Below the number of regions: each part lost less than one unit.
    let given: u128 = parts.iter().map(|&p| u128::from(p)).sum();
    let left = usize::try_from(u128::from(capacity) - given).unwrap_or(usize::MAX);
    let mut order: Vec<usize> = (0..weights.len()).collect();
    // Largest remainder first, ties in index order, as the home script sorts them.
    order.sort_by_key(|&i| (std::cmp::Reverse(rems[i]), i));
    for &i in order.iter().take(left) {
        parts[i] += 1;
    }
    parts
}

/// Max-min fair division (water filling): the smallest wants first, each getting at most an
/// equal share of what is left; rounding leftovers pass on to the next (larger) wants.
fn fair_share(capacity: u64, wants: &[u64]) -> Vec<u64> {
    let mut order: Vec<usize> = (0..wants.len()).collect();
    // Ties in index order, as the home script sorts them.
    order.sort_by_key(|&i| (wants[i], i));
    let mut out = vec![0; wants.len()];
    let mut left = capacity;
    for (k, &i) in order.iter().enumerate() {
        let sharing = (wants.len() - k) as u64;
        let give = wants[i].min(left / sharing);
        out[i] = give;
        left -= give;
    }
    out
}

/// A region's want from its measured demand: the demand plus an eighth (at least 1), so a
/// region that uses all of its share asks for a little more and can grow.
pub(crate) fn want(demand: u64) -> u64 {
    demand.saturating_add((demand / 8).max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doorman_example() {
        assert_eq!(
            Allocation::FairShare.divide(120, &[1, 1, 1], &[1000, 50, 10]),
            [60, 50, 10]
        );
        assert_eq!(
            Allocation::ProportionalShare.divide(120, &[1, 1, 1], &[1000, 50, 10]),
            [113, 6, 1]
        );
    }

    #[test]
    fn rounding_leftovers_go_to_the_largest_wants() {
        assert_eq!(
            Allocation::FairShare.divide(100, &[1, 1, 1], &[1000, 1000, 1000]),
            [33, 33, 34]
        );
    }

    #[test]
    fn wants_that_fit_are_met() {
        assert_eq!(
            Allocation::FairShare.divide(100, &[1, 1], &[10, 20]),
            [10, 20]
        );
        assert_eq!(
            Allocation::ProportionalShare.divide(100, &[1, 1], &[10, 20]),
            [10, 20]
        );
    }
}
