//! The block manager against a reference model under random operations, and
//! the cases a scheduler relies on.

use tessera_core::Error;

use super::pool::BlockState;
use super::{BlockId, BlockManager, BlockTable, KvBudget};
use crate::test_data::Gen;

/// A live sequence of the model: its table and what its tokens are.
struct Seq {
    table: BlockTable,
    tokens: Vec<u32>,
}

/// The reference: the sequences, and what each cache slot holds. A slot's
/// K/V depends on every token up to its own, so the model stores that whole
/// prefix: a block reused for the wrong prefix shows up even where its own
/// tokens match.
struct Model {
    manager: BlockManager,
    seqs: Vec<Seq>,
    slots: Vec<Vec<Option<Vec<u32>>>>,
}

impl Model {
    fn new(num_blocks: usize, block_size: usize, watermark: usize) -> Self {
        let manager = BlockManager::new(num_blocks, block_size).unwrap().with_watermark(watermark).unwrap();
        Model { manager, seqs: Vec::new(), slots: vec![vec![None; block_size]; num_blocks] }
    }

    /// The engine writing the K/V of `seq`'s tokens from `from` on: each
    /// written block must be private to the sequence.
    fn write(&mut self, seq: usize, from: usize) {
        let s = &self.seqs[seq];
        for p in from..s.tokens.len() {
            let slot = s.table.slot(p).unwrap();
            assert_eq!(self.manager.refcount(slot.block), 1, "block {} is written while shared (position {p})", slot.block);
            self.slots[slot.block as usize][slot.offset] = Some(s.tokens[..=p].to_vec());
        }
    }

    fn admit(&mut self, prompt: Vec<u32>) {
        let expected = self.manager.can_admit(&prompt);
        let before = self.counts();
        match self.manager.admit(&prompt) {
            Ok(admission) => {
                assert!(expected, "admit succeeded where can_admit said no");
                let bs = self.manager.block_size();
                assert_eq!(admission.cached_tokens % bs, 0);
                assert!(admission.cached_tokens < prompt.len(), "the last prompt token must be computed");
                self.seqs.push(Seq { table: admission.table, tokens: prompt });
                self.write(self.seqs.len() - 1, admission.cached_tokens);
            }
            Err(e) => {
                assert!(!expected, "admit failed where can_admit said yes: {e}");
                assert!(matches!(e, Error::InsufficientMemory { .. }), "{e}");
                assert_eq!(self.counts(), before, "a failed admit changed the cache");
            }
        }
    }

    fn append(&mut self, seq: usize, token: u32) {
        let expected = self.manager.can_append(&self.seqs[seq].table);
        let before = self.counts();
        let old_last = self.seqs[seq].table.blocks().last().copied();
        match self.manager.append(&mut self.seqs[seq].table, token) {
            Ok(copy) => {
                assert!(expected, "append succeeded where can_append said no");
                if let Some(copy) = copy {
                    assert_eq!(Some(copy.src), old_last, "the copy's source is not the block appended into");
                    assert_eq!(self.seqs[seq].table.blocks().last(), Some(&copy.dst));
                    self.slots[copy.dst as usize] = self.slots[copy.src as usize].clone();
                }
                self.seqs[seq].tokens.push(token);
                let len = self.seqs[seq].tokens.len();
                self.write(seq, len - 1);
            }
            Err(e) => {
                assert!(!expected, "append failed where can_append said yes: {e}");
                assert!(matches!(e, Error::InsufficientMemory { .. }), "{e}");
                assert_eq!(self.counts(), before, "a failed append changed the cache");
                assert_eq!(self.seqs[seq].table.len(), self.seqs[seq].tokens.len(), "a failed append changed the table");
            }
        }
    }

    /// Preemption: free the sequence and admit its tokens again at once; every
    /// block it had computed must come back as a hit.
    fn preempt_and_readmit(&mut self, seq: usize, committed_blocks: usize) {
        let Seq { table, tokens } = self.seqs.swap_remove(seq);
        self.manager.free(table);
        if !self.manager.can_admit(&tokens) {
            return;
        }
        let bs = self.manager.block_size();
        let admission = self.manager.admit(&tokens).unwrap();
        let reusable = (tokens.len() - 1) / bs;
        assert!(admission.cached_tokens >= committed_blocks.min(reusable) * bs, "re-admission lost prefix hits");
        self.seqs.push(Seq { table: admission.table, tokens });
        self.write(self.seqs.len() - 1, admission.cached_tokens);
    }

    fn counts(&self) -> (usize, usize, usize) {
        (self.manager.available_blocks(), self.manager.free_blocks(), self.manager.evictable_blocks())
    }

    fn check(&self) {
        let pool = self.manager.pool();
        pool.audit().unwrap();
        let n = self.manager.num_blocks();
        let bs = self.manager.block_size();
        let mut references = vec![0u32; n];
        for s in &self.seqs {
            assert_eq!(s.table.tokens(), &s.tokens[..]);
            assert_eq!(s.table.len(), s.tokens.len());
            assert_eq!(s.table.blocks().len(), s.tokens.len().div_ceil(bs));
            for &b in s.table.blocks() {
                references[b as usize] += 1;
            }
            for p in 0..s.tokens.len() {
                let slot = s.table.slot(p).unwrap();
                assert_eq!(self.slots[slot.block as usize][slot.offset].as_deref(), Some(&s.tokens[..=p]), "block {} holds other K/V", slot.block);
            }
            assert_eq!(s.table.slot(s.tokens.len()), None);
        }
        let mut in_use = 0;
        for (b, &refs) in references.iter().enumerate() {
            let state = pool.state(b as BlockId);
            match refs {
                0 => assert!(matches!(state, BlockState::Free | BlockState::Evictable), "block {b} is unreferenced but {state:?}"),
                r => {
                    assert_eq!(state, BlockState::InUse(r), "block {b}: refcount against {r} tables referencing it");
                    in_use += 1;
                }
            }
        }
        assert_eq!(self.manager.free_blocks() + self.manager.evictable_blocks() + in_use, n, "blocks are not conserved");
    }
}

/// A prompt that often shares a prefix with others: one of a few "system
/// prompts" and a short suffix over a two-token alphabet.
fn prompt(rng: &mut Gen, bs: usize) -> Vec<u32> {
    let systems: [&[u32]; 3] = [&[7, 7, 7, 7, 7, 7, 7, 7, 7], &[7, 7, 7, 7, 8, 8], &[]];
    let mut p = systems[rng.below(3)].to_vec();
    let suffix = rng.below(2 * bs + 1);
    p.extend((0..suffix).map(|_| rng.below(2) as u32));
    if p.is_empty() {
        p.push(1);
    }
    p
}

#[test]
fn random_operations_agree_with_the_model() {
    for seed in 0..300u64 {
        let mut rng = Gen::new(seed);
        let bs = 1 + rng.below(4);
        let num_blocks = 4 + rng.below(12);
        let watermark = rng.below(2);
        let mut m = Model::new(num_blocks, bs, watermark);
        for _ in 0..200 {
            let live = m.seqs.len();
            match rng.below(11) {
                0..=2 => m.admit(prompt(&mut rng, bs)),
                3..=5 if live > 0 => m.append(rng.below(live), rng.below(2) as u32),
                6 if live > 0 => {
                    let i = rng.below(live);
                    let table = m.manager.fork(&m.seqs[i].table);
                    let tokens = m.seqs[i].tokens.clone();
                    m.seqs.push(Seq { table, tokens });
                }
                7 if live > 0 => {
                    let s = m.seqs.swap_remove(rng.below(live));
                    m.manager.free(s.table);
                }
                8 if live > 0 => {
                    let i = rng.below(live);
                    let computed = rng.below(m.seqs[i].tokens.len() + 1);
                    m.manager.commit(&mut m.seqs[i].table, computed);
                }
                9 if live > 0 => {
                    let i = rng.below(live);
                    let len = m.seqs[i].tokens.len();
                    m.manager.commit(&mut m.seqs[i].table, len);
                    m.preempt_and_readmit(i, len / bs);
                }
                10 if live > 0 => {
                    // Speculative tokens rejected: cut back to a random length above the committed blocks.
                    let i = rng.below(live);
                    let committed = m.seqs[i].table.hashes.len() * bs;
                    let len = m.seqs[i].tokens.len();
                    let to = committed.max(1) + rng.below(len - committed.max(1) + 1);
                    m.manager.truncate(&mut m.seqs[i].table, to).unwrap();
                    m.seqs[i].tokens.truncate(to);
                    assert!(m.manager.truncate(&mut m.seqs[i].table, to + 1).is_err(), "cannot grow by truncating");
                    if committed > 0 {
                        assert!(m.manager.truncate(&mut m.seqs[i].table, committed - 1).is_err(), "cannot cut a committed block");
                    }
                }
                _ => {}
            }
            m.check();
        }
    }
}

#[test]
fn a_shared_system_prompt_is_computed_once() {
    let mut manager = BlockManager::new(64, 16).unwrap();
    let system: Vec<u32> = (0..40).collect();
    let ask = |question: u32| -> Vec<u32> { system.iter().copied().chain([1000 + question; 5]).collect() };

    let mut first = manager.admit(&ask(1)).unwrap();
    assert_eq!(first.cached_tokens, 0);
    let len = first.table.len();
    manager.commit(&mut first.table, len);

    // 40 system tokens fill two 16-token blocks; the third mixes in the question.
    let second = manager.admit(&ask(2)).unwrap();
    assert_eq!(second.cached_tokens, 32);
    assert_eq!(second.table.blocks()[..2], first.table.blocks()[..2]);
    assert_ne!(second.table.blocks()[2], first.table.blocks()[2]);
    for &b in &first.table.blocks()[..2] {
        assert_eq!(manager.refcount(b), 2);
    }
    // 45 tokens need 3 blocks each; the two shared ones count once.
    assert_eq!(manager.available_blocks(), 64 - 4);

    // Finished requests leave the prefix cached, as evictable blocks.
    manager.free(first.table);
    manager.free(second.table);
    // The two shared blocks; each request's third block was never cached (not full), so it is free.
    assert_eq!(manager.evictable_blocks(), 2);
    let third = manager.admit(&ask(3)).unwrap();
    assert_eq!(third.cached_tokens, 32);
    manager.free(third.table);
}

#[test]
fn a_preempted_sequence_finds_its_computed_blocks_again() {
    let mut manager = BlockManager::new(16, 16).unwrap();
    let prompt: Vec<u32> = (0..50).collect();
    let mut seq = manager.admit(&prompt).unwrap().table;
    manager.commit(&mut seq, 50);
    for token in 0..20 {
        let copy = manager.append(&mut seq, 500 + token).unwrap();
        assert_eq!(copy, None);
    }
    manager.commit(&mut seq, 70);
    let tokens = seq.tokens().to_vec();
    let blocks = seq.blocks()[..4].to_vec();
    manager.free(seq);

    let again = manager.admit(&tokens).unwrap();
    // 70 tokens: four full blocks, all computed; the fifth is partial.
    assert_eq!(again.cached_tokens, 64);
    assert_eq!(again.table.blocks()[..4], blocks[..]);
    manager.free(again.table);
}

#[test]
fn the_last_prompt_token_is_always_computed() {
    let mut manager = BlockManager::new(8, 4).unwrap();
    let prompt: Vec<u32> = (0..8).collect();
    let mut a = manager.admit(&prompt).unwrap().table;
    manager.commit(&mut a, 8);
    let b = manager.admit(&prompt).unwrap();
    // Both blocks are cached, but the second holds the last token, whose logits the prefill must produce.
    assert_eq!(b.cached_tokens, 4);
    assert_ne!(b.table.blocks()[1], a.blocks()[1]);
    manager.free(a);
    manager.free(b.table);
}

#[test]
fn a_fork_copies_the_shared_block_before_writing() {
    let mut manager = BlockManager::new(8, 4).unwrap();
    let mut parent = manager.admit(&[1, 2, 3, 4, 5, 6]).unwrap().table;
    let mut child = manager.fork(&parent);
    assert_eq!(child.blocks(), parent.blocks());
    assert_eq!(manager.refcount(parent.blocks()[1]), 2);

    let copy = manager.append(&mut child, 7).unwrap().expect("the shared last block must be copied");
    assert_eq!(copy.src, parent.blocks()[1]);
    assert_eq!(copy.dst, child.blocks()[1]);
    assert_eq!(child.blocks()[0], parent.blocks()[0], "the full first block stays shared");
    // The parent is the last holder of its block now: no copy.
    assert_eq!(manager.append(&mut parent, 8).unwrap(), None);
    manager.free(parent);
    manager.free(child);
    assert_eq!(manager.free_blocks(), 8);
}

#[test]
fn exhaustion_is_an_error_the_scheduler_can_act_on() {
    let mut manager = BlockManager::new(4, 4).unwrap();
    let mut a = manager.admit(&[0; 16]).unwrap().table;
    assert!(!manager.can_admit(&[1]));
    let e = manager.admit(&[1]).unwrap_err();
    assert!(matches!(e, Error::InsufficientMemory { .. }), "{e}");
    assert!(!manager.can_append(&a));
    let e = manager.append(&mut a, 9).unwrap_err();
    assert!(e.to_string().contains("preempt"), "{e}");
    assert_eq!(a.len(), 16);

    // Preempting the sequence makes room again.
    manager.free(a);
    assert!(manager.can_admit(&[1]));
    assert!(manager.admit(&[]).is_err(), "an empty prompt is refused");
}

#[test]
fn the_watermark_holds_blocks_back_from_admission_only() {
    let mut manager = BlockManager::new(4, 4).unwrap().with_watermark(1).unwrap();
    assert!(!manager.can_admit(&[0; 16]));
    let mut a = manager.admit(&[0; 12]).unwrap().table;
    assert!(!manager.can_admit(&[1]));
    for t in 0..4 {
        manager.append(&mut a, t).unwrap();
    }
    assert_eq!(manager.available_blocks(), 0);
    manager.free(a);
    assert!(BlockManager::new(4, 4).unwrap().with_watermark(4).is_err());
    assert!(BlockManager::new(4, 0).is_err());
    assert!(BlockManager::new(0, 16).is_err());
}

#[test]
fn the_budget_matches_a_hand_computation() {
    // A Llama-3-8B-shaped cache: 32 layers, 8 KV heads of 128, bf16.
    let budget = KvBudget { memory_bytes: 10 << 30, layers: 32, kv_heads: 8, head_dim: 128, dtype_bytes: 2, block_size: 16, max_seq_len: 8192 };
    // 2 (K and V) · 32 · 8 · 128 · 16 · 2 = 2 MiB a block.
    assert_eq!(budget.bytes_per_block().unwrap(), 2 * 1024 * 1024);
    assert_eq!(budget.num_blocks().unwrap(), 5120);
    // One byte short of 5121 blocks is still 5120.
    assert_eq!(KvBudget { memory_bytes: 5121 * (2 << 20) - 1, ..budget }.num_blocks().unwrap(), 5120);

    let e = KvBudget { memory_bytes: 1 << 20, ..budget }.num_blocks().unwrap_err();
    assert!(matches!(e, Error::InsufficientMemory { .. }) && e.to_string().contains("cannot hold one block"), "{e}");
    // 100 MiB holds 50 blocks = 800 tokens; 8192 tokens need 512 blocks.
    let e = KvBudget { memory_bytes: 100 << 20, ..budget }.num_blocks().unwrap_err();
    assert!(e.to_string().contains("needs 512 blocks") && e.to_string().contains("lower max_seq_len to 800"), "{e}");
    let e = KvBudget { kv_heads: 0, ..budget }.num_blocks().unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }) && e.to_string().contains("kv_heads"), "{e}");
    let e = KvBudget { layers: usize::MAX, ..budget }.bytes_per_block().unwrap_err();
    assert!(e.to_string().contains("overflows"), "{e}");
}
