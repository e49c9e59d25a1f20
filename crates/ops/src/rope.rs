//! Rotary position embedding frequencies (with Llama 3 scaling).

use vellum_base::{ModelConfig, RopeScaling};

/// The inverse frequencies of one head's rotation pairs.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeTable {
    /// `head_dim / 2` inverse frequencies.
    pub inv_freq: Vec<f64>,
    /// Positions the model addresses (`max_position_embeddings`); a
    /// backend that tabulates the rotations covers `0..max_positions`.
    pub max_positions: usize,
}

impl RopeTable {
    /// Frequencies for `config` (`rope_theta`, `rope_scaling`).
    pub fn new(config: &ModelConfig) -> Self {
        Self::with_base(config, config.rope_theta, true)
    }

    /// Frequencies of base `base`, with `config.rope_scaling` applied when
    /// `scaled` (Gemma 3 scales its global layers only).
    pub fn with_base(config: &ModelConfig, base: f32, scaled: bool) -> Self {
        let hd = config.head_dim;
        let base = base as f64;
        let mut inv_freq: Vec<f64> = (0..hd / 2).map(|i| 1.0 / base.powf(2.0 * i as f64 / hd as f64)).collect();
        let scaling = if scaled { config.rope_scaling.clone() } else { None };
        match scaling {
            Some(RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings }) => {
                let (factor, lo, hi) = (factor as f64, low_freq_factor as f64, high_freq_factor as f64);
                let old_len = original_max_position_embeddings as f64;
                let (low_wavelen, high_wavelen) = (old_len / lo, old_len / hi);
                for f in inv_freq.iter_mut() {
                    let wavelen = 2.0 * std::f64::consts::PI / *f;
                    if wavelen > low_wavelen {
                        *f /= factor;
                    } else if wavelen >= high_wavelen {
                        let smooth = (old_len / wavelen - lo) / (hi - lo);
                        *f = (1.0 - smooth) * *f / factor + smooth * *f;
                    }
                }
            }
            Some(RopeScaling::Linear { factor }) => {
                for f in inv_freq.iter_mut() {
                    *f /= factor as f64;
                }
            }
            None => {}
        }
        Self { inv_freq, max_positions: config.max_position_embeddings }
    }

    /// Width of the head the table rotates.
    pub fn head_dim(&self) -> usize {
        2 * self.inv_freq.len()
    }

    /// `(cos, sin)` of every pair at `position`, in f32.
    pub fn cos_sin(&self, position: u32, cos: &mut [f32], sin: &mut [f32]) {
        for (i, f) in self.inv_freq.iter().enumerate() {
            let angle = position as f64 * f;
            cos[i] = angle.cos() as f32;
            sin[i] = angle.sin() as f32;
        }
    }
}
