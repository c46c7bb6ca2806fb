//! A small deterministic random number generator (SplitMix64), so that initialisation
//! and synthetic data are identical run to run and rank to rank for a given seed.

/// SplitMix64: fast, seedable, good enough for initialisation and synthetic data.
#[derive(Debug, Clone)]
pub struct Rng {
    state: u64,
}

impl Rng {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Self {
        Rng {
            state: seed ^ 0x9E37_79B9_7F4A_7C15,
        }
    }

    /// Where the generator stands: [`Rng::at`] of it continues from here.
    pub fn position(&self) -> u64 {
        self.state
    }

    /// A generator standing where one whose [`Rng::position`] was `position` stood.
    pub fn at(position: u64) -> Self {
        Rng { state: position }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Moves past the next `n` outputs of [`Rng::next_u64`] without computing them (each
    /// output depends only on how many came before it): how a rank draws its slice of a
    /// parameter's initial values exactly as the whole parameter's draw would.
    pub fn skip(&mut self, n: u64) {
        self.state = self.state.wrapping_add(n.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform integer in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// Standard normal (Box-Muller): two outputs of [`Rng::next_u64`] each.
    pub fn normal(&mut self) -> f64 {
        let u1 = self.uniform().max(f64::MIN_POSITIVE);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}

#[cfg(test)]
mod tests {
    use super::Rng;

    #[test]
    fn skipping_n_outputs_lands_where_drawing_them_does() {
        let mut drawn = Rng::new(7);
        for _ in 0..1001 {
            drawn.next_u64();
        }
        let mut skipped = Rng::new(7);
        skipped.skip(1001);
        assert_eq!(drawn.next_u64(), skipped.next_u64());
        // a normal draws two outputs
        let (mut a, mut b) = (Rng::new(3), Rng::new(3));
        a.normal();
        b.skip(2);
        assert_eq!(a.next_u64(), b.next_u64());
    }
}
