//! Workspaces entered in turn on a thread hand their empty regions on through the lot
//! (`rustws_core::lot`). In a binary of its own: the lot is one per process, and another test's
//! workspaces would take regions from it or park theirs.

mod common;

use std::ptr::NonNull;

use common::{fill, intact, miri_or};
use rustws_core::*;

/// Held by each test while it runs: the tests of one binary run on parallel threads.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn alone() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// A layer's blocks (smaller under Miri, which runs every byte's check slowly).
const SIZE: usize = miri_or(48 << 10, 4 << 10);

fn layers(n: usize, config: WorkspaceConfiguration) -> Vec<Workspace> {
    (0..n).map(|i| Workspace::new(&format!("LAYER{i}"), config.clone()).expect("a workspace")).collect()
}

fn adaptive() -> WorkspaceConfiguration {
    WorkspaceConfiguration {
        policy_learning: LearningPolicy::Adaptive,
        policy_spill: SpillPolicy::Reallocate,
        ..WorkspaceConfiguration::default()
    }
}

/// The base of the region holding `p`, a live block of `w` (0: outside the arena).
fn region_of(w: &Workspace, p: NonNull<u8>) -> usize {
    // SAFETY: `p` is a live block of `w`.
    let info = unsafe { w.find_block(p) }.expect("a live block of the workspace");
    info.region.map_or(0, |r| r.0)
}

/// One pass of a network whose layers each have a workspace: a layer's cycle carves a temporary
/// and its output, and frees the output of the layer before it (as `x = f(x)` replaces it).
/// Returns, per layer, the region its output lies in.
fn pass(ws: &mut [Workspace], x: &mut Option<(usize, NonNull<u8>, u8)>, seed: u8) -> Vec<usize> {
    pass_of(ws, &vec![SIZE; ws.len()], x, seed)
}

/// [`pass`], with layer `i`'s blocks of `sizes[i]` bytes.
fn pass_of(ws: &mut [Workspace], sizes: &[usize], x: &mut Option<(usize, NonNull<u8>, u8)>, seed: u8) -> Vec<usize> {
    let order: Vec<usize> = (0..ws.len()).collect();
    pass_in(ws, &order, sizes, x, seed)
}

/// [`pass_of`], through the layers in `order` (backwards, for a backward pass).
fn pass_in(
    ws: &mut [Workspace],
    order: &[usize],
    sizes: &[usize],
    x: &mut Option<(usize, NonNull<u8>, u8)>,
    seed: u8,
) -> Vec<usize> {
    let mut regions = Vec::new();
    for &i in order {
        let size = sizes[i];
        ws[i].enter().unwrap();
        let t = ws[i].alloc(size).unwrap();
        fill(t.as_ptr(), size, seed);
        let out = ws[i].alloc(size).unwrap();
        let s = seed.wrapping_add(i as u8);
        fill(out.as_ptr(), size, s);
        if let Some((j, p, s)) = x.take() {
            assert!(intact(p.as_ptr(), sizes[j], s), "layer {j}'s output changed under it");
            // SAFETY: a live block of layer `j`, freed once.
            unsafe { ws[j].free(p) };
        }
        // SAFETY: live, freed once.
        unsafe { ws[i].free(t) };
        ws[i].exit().unwrap();
        regions.push(region_of(&ws[i], out));
        *x = Some((i, out, s));
    }
    regions
}

fn distinct(mut v: Vec<usize>) -> usize {
    v.sort_unstable();
    v.dedup();
    v.len()
}

#[test]
fn workspaces_entered_in_turn_hand_their_empty_regions_on() {
    let _alone = alone();
    let mut ws = layers(4, adaptive());
    let mut x = None;
    let mut last = Vec::new();
    for round in 0..8u8 {
        last = pass(&mut ws, &mut x, round.wrapping_mul(17));
        for w in &ws {
            w.verify();
        }
    }
    // Two regions serve the four layers: the one holding the last layer's output, and the one
    // the next layer carves in; each layer once had a region of its own.
    assert_eq!(distinct(last.clone()), 2, "regions of the last pass: {last:x?}");
    let held: usize = ws.iter().map(|w| w.stats().capacity_bytes as usize).sum();
    let (parked, parked_bytes) = lot::parked();
    let one = ws.iter().map(|w| w.stats().capacity_bytes as usize).max().unwrap();
    assert!(held + parked_bytes <= 2 * one, "held {held} and parked {parked_bytes} ({parked} regions)");
    // A layer idle since its output died holds no region; it takes one again as it opens.
    assert_eq!(ws[0].stats().capacity_bytes, 0);
    let (j, p, s) = x.take().unwrap();
    assert!(intact(p.as_ptr(), SIZE, s));
    // SAFETY: a live block of layer `j`, freed once.
    unsafe { ws[j].free(p) };
    ws[0].enter().unwrap();
    assert!(ws[0].stats().capacity_bytes > 0, "a region at the open");
    let q = ws[0].alloc(SIZE).unwrap();
    assert!(region_of(&ws[0], q) != 0);
    // SAFETY: live, freed once.
    unsafe { ws[0].free(q) };
    ws[0].exit().unwrap();
    for w in &ws {
        w.verify();
        assert_eq!(w.live_blocks(), 0);
        assert_eq!(w.bad_frees(), 0);
    }
}

#[test]
fn a_block_freed_twice_by_the_region_s_old_owner_leaves_the_new_owner_s_alone() {
    let _alone = alone();
    let mut ws = layers(3, adaptive());
    let mut x = None;
    for round in 0..6u8 {
        pass(&mut ws, &mut x, round);
    }
    // Layer 2's output dies in layer 0's next cycle, and layer 2 parks the region it lies in;
    // layer 1, whose own region layer 0 took over, takes that one as it opens (inside layer 0's
    // cycle here, so that layer 0 parks nothing meanwhile). The output's pointer, freed a second
    // time then, must not touch layer 1's block carved in its place.
    let (j, stale, s) = x.take().unwrap();
    assert_eq!(j, 2);
    let region = region_of(&ws[2], stale);
    ws[0].enter().unwrap();
    assert!(intact(stale.as_ptr(), SIZE, s));
    // SAFETY: live, freed once (here).
    unsafe { ws[2].free(stale) };
    assert_eq!(ws[2].stats().capacity_bytes, 0, "layer 2 parked its region");
    ws[1].enter().unwrap();
    // Carved as the pass carved them: a temporary first, then the block at the output's place.
    let t = ws[1].alloc(SIZE).unwrap();
    let fresh = ws[1].alloc(SIZE).unwrap();
    assert_eq!(region_of(&ws[1], fresh), region, "layer 1 serves from the region layer 2 left");
    assert_eq!(fresh, stale, "the same place, the region having started over");
    fill(fresh.as_ptr(), SIZE, 99);
    // SAFETY: `stale` is no live block of layer 2's any more (the region is layer 1's now): the
    // free is a second one, which the workspace must ignore without reading the memory.
    unsafe { ws[2].free(stale) };
    assert_eq!(ws[2].bad_frees(), 1, "a pointer into a region handed on is no block of the old owner");
    assert_eq!(ws[1].live_blocks(), 2);
    assert!(intact(fresh.as_ptr(), SIZE, 99), "the new owner's block stays as it was");
    // SAFETY: live, freed once.
    unsafe { ws[1].free(fresh) };
    // SAFETY: live, freed once.
    unsafe { ws[1].free(t) };
    ws[1].exit().unwrap();
    ws[0].exit().unwrap();
    for w in &ws {
        w.verify();
        assert_eq!(w.live_blocks(), 0);
    }
}

#[test]
fn a_workspace_entered_alone_or_given_its_size_keeps_its_region() {
    let _alone = alone();
    let before = lot::parked();
    // Alone: its output dies between cycles, and its region stays for the next one.
    let mut w = layers(1, adaptive());
    let mut x = None;
    for round in 0..6u8 {
        pass(&mut w, &mut x, round);
        let (_, p, _) = x.take().unwrap();
        // SAFETY: live, freed once, outside any cycle.
        unsafe { w[0].free(p) };
        assert!(w[0].stats().capacity_bytes > 0 || round == 0, "round {round}");
    }
    assert_eq!(lot::parked(), before);
    // Given a size (initial or least), each of several workspaces entered in turn keeps what it
    // was given, between its cycles too.
    for sized in [
        WorkspaceConfiguration { initial_size: 256 << 10, ..adaptive() },
        WorkspaceConfiguration { min_size: 256 << 10, ..adaptive() },
    ] {
        let mut ws = layers(3, sized);
        let mut x = None;
        let mut last = Vec::new();
        for round in 0..6u8 {
            last = pass(&mut ws, &mut x, round);
        }
        assert_eq!(distinct(last), 3);
        assert_eq!(lot::parked(), before);
        let (j, p, _) = x.take().unwrap();
        // SAFETY: live, freed once.
        unsafe { ws[j].free(p) };
        assert!(ws.iter().all(|w| w.stats().capacity_bytes >= 256 << 10));
    }
}

#[test]
fn the_regions_a_workspace_parked_go_back_with_it() {
    let _alone = alone();
    let before = lot::parked().0;
    let mut ws = layers(3, adaptive());
    let mut x = None;
    for round in 0..6u8 {
        pass(&mut ws, &mut x, round);
    }
    let (j, p, _) = x.take().unwrap();
    // SAFETY: live, freed once.
    unsafe { ws[j].free(p) };
    assert!(lot::parked().0 > before, "the last layer's region, empty now, waits in the lot");
    drop(ws);
    assert_eq!(lot::parked().0, before, "nothing the dropped workspaces parked stays mapped");
}

#[test]
fn layers_of_different_sizes_in_turn_settle_without_faulting_their_regions_again() {
    // Regions handed on between a narrow and a wide layer: one taken by the narrow layer keeps
    // what the wide one made resident (a shrink would give it back, and the wide layer fault it
    // in again at its next turn).
    let _alone = alone();
    let sizes = [SIZE, 8 * SIZE, 2 * SIZE, 6 * SIZE, 3 * SIZE];
    let mut ws = layers(sizes.len(), adaptive());
    let mut x = None;
    let prefaulted = |ws: &[Workspace]| ws.iter().map(Workspace::prefaulted_bytes).sum::<u64>();
    let (settle, more) = (miri_or(8, 4) as u8, miri_or(16, 3) as u8);
    for round in 0..settle {
        pass_of(&mut ws, &sizes, &mut x, round);
    }
    let settled = prefaulted(&ws);
    for round in settle..settle + more {
        pass_of(&mut ws, &sizes, &mut x, round);
        for w in &ws {
            w.verify();
        }
    }
    assert_eq!(prefaulted(&ws), settled, "no region was pre-faulted again once the layers settled");
    // Fewer regions than layers serve them: the widest ones, handed on.
    let held = ws.iter().filter(|w| w.stats().capacity_bytes > 0).count();
    assert!(held + lot::parked().0 <= 3, "{held} regions held, {:?} parked", lot::parked());
    let (j, p, _) = x.take().unwrap();
    // SAFETY: a live block of layer `j`, freed once.
    unsafe { ws[j].free(p) };
}

#[test]
fn regions_shrink_back_once_the_widest_layer_stops() {
    // A wide layer for a while, then narrow layers only: the regions the narrow ones take over
    // serve the wide need while it is still asked for, then give back the pages above theirs.
    let _alone = alone();
    let mut ws = layers(4, adaptive());
    let mut x = None;
    let mut wide = 0;
    for round in 0..8u8 {
        pass_of(&mut ws, &[SIZE, 8 * SIZE, SIZE, SIZE], &mut x, round);
        wide = wide.max(ws.iter().map(|w| w.stats().capacity_bytes as usize).max().unwrap());
    }
    for round in 8..miri_or(40, 30) as u8 {
        pass_of(&mut ws, &[SIZE; 4], &mut x, round);
    }
    let held: usize = ws.iter().map(|w| w.stats().capacity_bytes as usize).sum();
    let parked = lot::parked();
    assert!(held + parked.1 < wide, "{held} bytes held and {parked:?} parked, against one wide region of {wide}");
    let (j, p, _) = x.take().unwrap();
    // SAFETY: a live block of layer `j`, freed once.
    unsafe { ws[j].free(p) };
    for w in &ws {
        w.verify();
    }
}

#[test]
fn a_region_two_wide_layers_need_at_once_waits_out_the_narrow_pass_between() {
    // A training step through twelve layers, a workspace each: a narrow forward pass, then a
    // backward pass whose layers 2 and 1 are wide, layer 2's output living through layer 1's
    // cycle. Two wide regions serve the backward pass, and the second waits in the lot through
    // the forward pass (some forty parks and takes): it must still be there, not go back to the
    // system and be mapped and pre-faulted again at every step.
    let _alone = alone();
    let n = 12;
    let forward = vec![SIZE; n];
    let mut backward = vec![SIZE; n];
    (backward[1], backward[2]) = (12 * SIZE, 6 * SIZE);
    let mut ws = layers(n, adaptive());
    let mut x = None;
    let prefaulted = |ws: &[Workspace]| ws.iter().map(Workspace::prefaulted_bytes).sum::<u64>();
    let (down, up): (Vec<usize>, Vec<usize>) = ((0..n).collect(), (0..n).rev().collect());
    let step = |ws: &mut [Workspace], x: &mut Option<(usize, NonNull<u8>, u8)>, round: u8| {
        pass_in(ws, &down, &forward, x, round);
        pass_in(ws, &up, &backward, x, round.wrapping_add(100));
    };
    let (settle, more) = (miri_or(6, 4) as u8, miri_or(10, 2) as u8);
    for round in 0..settle {
        step(&mut ws, &mut x, round);
    }
    let settled = prefaulted(&ws);
    for round in settle..settle + more {
        step(&mut ws, &mut x, round);
        for w in &ws {
            w.verify();
        }
    }
    assert_eq!(prefaulted(&ws), settled, "a region was pre-faulted again at every step");
    let (j, p, _) = x.take().unwrap();
    // SAFETY: a live block of layer `j`, freed once.
    unsafe { ws[j].free(p) };
}
