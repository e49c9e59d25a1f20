//! KV-cache groups: which layers share a block table (vLLM's hybrid KV-cache
//! manager).
//!
//! A model whose layers all attend the same way keeps one block table per
//! sequence, and a block holds one `block_size`-token slab of every layer.
//! A model that mixes local (sliding-window) and global layers — Gemma 3
//! has five local layers per global one — would waste most of that memory:
//! a local layer needs only its window, a global layer everything. So the
//! layers are split into *groups of equal size*, each group made of layers
//! of one attention kind, and every group gets its own block table over one
//! shared pool:
//!
//! ```text
//!  Gemma 3 270M, 18 layers (L = local, window 512; G = global):
//!   layer  0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17
//!   kind   L L L L L G L L L L L  G  L  L  L  L  L  G
//!   group  1 1 1 2 2 0 2 3 3 3 4  0  4  4  5  5  5  0     (6 groups of 3 layers)
//!   slot   0 1 2 0 1 0 2 0 1 2 0  1  1  2  0  1  2  2     (position in its group)
//!
//!  one block = 3 layer slots × block_size tokens × K and V
//!  block table of a sequence, groups interleaved: entry i·G + g is logical
//!  block i (tokens i·bs .. (i+1)·bs) of group g
//! ```
//!
//! A physical block belongs to one group at a time; slot `s` of a block
//! holds the K/V of the group's `s`-th layer. The global group keeps every
//! block; a local group's blocks that slid out of its window are released
//! (their entries become [`BlockId::NULL`](crate::BlockId::NULL)), so a long
//! sequence costs about `n / bs` global blocks plus `window / bs + 1` blocks
//! per local group, instead of `n / bs` blocks of all 18 layers.
//!
//! The group size is the greatest common divisor of the number of layers of
//! each kind (15 local and 3 global: 3), so no slot is ever empty.

/// One group of layers sharing a block table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvCacheGroup {
    /// Keys visible to a query in these layers (`None`: full attention).
    pub sliding_window: Option<usize>,
    /// The group's layers in slot order.
    pub layers: Vec<usize>,
}

/// Where one layer's K/V live: which group's block table addresses them,
/// and which slot of a block holds them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayerSlot {
    /// The group (index into [`KvCacheGroups::groups`]).
    pub group: usize,
    /// The slot within a block (`0..layers_per_group`).
    pub slot: usize,
}

/// The split of a model's layers into KV-cache groups of equal size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvCacheGroups {
    groups: Vec<KvCacheGroup>,
    layer_slots: Vec<KvLayerSlot>,
}

impl KvCacheGroups {
    /// One group of every layer, attending with `sliding_window` (the
    /// manager releases blocks that slid out of it when it is `Some`).
    pub fn single(num_layers: usize, sliding_window: Option<usize>) -> Self {
        let layers: Vec<usize> = (0..num_layers).collect();
        let layer_slots = (0..num_layers).map(|slot| KvLayerSlot { group: 0, slot }).collect();
        Self { groups: vec![KvCacheGroup { sliding_window, layers }], layer_slots }
    }

    /// Groups of equal size for layers with these windows (`None`: global).
    ///
    /// Layers of one kind fill groups in layer order; global groups come
    /// first, then each window in increasing order. The group size is the
    /// gcd of the layer counts of every kind, so all groups are full.
    pub fn hybrid(layer_windows: &[Option<usize>]) -> Self {
        let mut kinds: Vec<Option<usize>> = layer_windows.to_vec();
        kinds.sort_unstable();
        kinds.dedup();
        if kinds.len() <= 1 {
            return Self::single(layer_windows.len(), kinds.first().copied().flatten());
        }
        let count = |k: Option<usize>| layer_windows.iter().filter(|&&w| w == k).count();
        let size = kinds.iter().map(|&k| count(k)).fold(0, gcd);
        let mut groups = Vec::new();
        let mut layer_slots = vec![KvLayerSlot { group: 0, slot: 0 }; layer_windows.len()];
        for &kind in &kinds {
            let layers: Vec<usize> = (0..layer_windows.len()).filter(|&l| layer_windows[l] == kind).collect();
            for chunk in layers.chunks(size) {
                for (slot, &l) in chunk.iter().enumerate() {
                    layer_slots[l] = KvLayerSlot { group: groups.len(), slot };
                }
                groups.push(KvCacheGroup { sliding_window: kind, layers: chunk.to_vec() });
            }
        }
        Self { groups, layer_slots }
    }

    /// The groups, in block-table order.
    pub fn groups(&self) -> &[KvCacheGroup] {
        &self.groups
    }

    /// Number of groups (`G`: a block table has `G` entries per logical block).
    pub fn num_groups(&self) -> usize {
        self.groups.len()
    }

    /// Layers per group: the K/V slots of one block.
    pub fn layers_per_group(&self) -> usize {
        self.groups.first().map_or(0, |g| g.layers.len())
    }

    /// Layers in the model.
    pub fn num_layers(&self) -> usize {
        self.layer_slots.len()
    }

    /// Where `layer`'s K/V live.
    ///
    /// # Panics
    /// If `layer` is not a layer of the model (a bug in model code).
    pub fn slot(&self, layer: usize) -> KvLayerSlot {
        self.layer_slots[layer]
    }

    /// Each group's window, in block-table order.
    pub fn windows(&self) -> Vec<Option<usize>> {
        self.groups.iter().map(|g| g.sliding_window).collect()
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemma3_270m_splits_into_six_groups_of_three() {
        let windows: Vec<Option<usize>> = (0..18).map(|l| if l % 6 == 5 { None } else { Some(512) }).collect();
        let g = KvCacheGroups::hybrid(&windows);
        assert_eq!((g.num_groups(), g.layers_per_group(), g.num_layers()), (6, 3, 18));
        assert_eq!(g.groups()[0], KvCacheGroup { sliding_window: None, layers: vec![5, 11, 17] });
        assert_eq!(g.groups()[1].layers, vec![0, 1, 2]);
        assert_eq!(g.groups()[2].layers, vec![3, 4, 6]);
        assert_eq!(g.slot(11), KvLayerSlot { group: 0, slot: 1 });
        assert_eq!(g.slot(6), KvLayerSlot { group: 2, slot: 2 });
        // Every (group, slot) pair names exactly one layer.
        let mut seen: Vec<KvLayerSlot> = (0..18).map(|l| g.slot(l)).collect();
        seen.sort_by_key(|s| (s.group, s.slot));
        seen.dedup();
        assert_eq!(seen.len(), 18);
    }

    #[test]
    fn uniform_models_keep_one_group() {
        assert_eq!(KvCacheGroups::hybrid(&[None; 4]), KvCacheGroups::single(4, None));
        let m = KvCacheGroups::hybrid(&[Some(6); 3]);
        assert_eq!((m.num_groups(), m.layers_per_group(), m.windows()), (1, 3, vec![Some(6)]));
    }

    #[test]
    fn coprime_counts_give_groups_of_one_layer() {
        let g = KvCacheGroups::hybrid(&[Some(4), Some(4), None]);
        assert_eq!((g.num_groups(), g.layers_per_group()), (3, 1));
        assert_eq!(g.windows(), vec![None, Some(4), Some(4)]);
    }
}
