//! The whole model's parameters as checkpoints record them: under expert parallelism a rank
//! declares only its own experts and names the others (`Model::held_elsewhere`), and a
//! checkpoint lists every parameter, in one order whatever the layout, with the store that
//! held each.

use crate::model::{Model, ParamSpec};

/// A parameter of the whole model: its spec, the pipeline stage holding it and, under
/// expert parallelism, the expert-parallel rank whose experts' store holds it (None: the
/// dense store).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Placed {
    pub spec: ParamSpec,
    pub stage: usize,
    pub holder: Option<usize>,
}

/// One of this rank's parameters: its spec, the index of the layer declaring it, its stage.
pub(crate) type Declared = (ParamSpec, usize, usize);

/// Each of `model`'s parameters' layer, in `Model::params` order.
pub(crate) fn layer_of(model: &Model) -> Vec<usize> {
    let layers = model.layers().iter().enumerate();
    layers
        .flat_map(|(i, l)| std::iter::repeat_n(i, l.params().len()))
        .collect()
}

/// This rank's parameters with their layers and stages.
pub(crate) fn declared(
    specs: &[ParamSpec],
    layer_of: &[usize],
    stage_of: &[usize],
) -> Vec<Declared> {
    let each = specs.iter().zip(layer_of).zip(stage_of);
    each.map(|((p, &layer), &stage)| (p.clone(), layer, stage))
        .collect()
}

/// This rank's parameters where they are, in the dense store of their stage.
pub(crate) fn in_place<'a>(
    specs: &'a [ParamSpec],
    stage_of: &'a [usize],
) -> impl Iterator<Item = Placed> + 'a {
    specs.iter().zip(stage_of).map(|(p, &stage)| Placed {
        spec: p.clone(),
        stage,
        holder: None,
    })
}

/// Note [the whole model under expert parallelism]: a checkpoint must list the same
/// parameters in the same order at every ep, so that one saved at ep 2 loads at ep 4 or 1
/// (names and shapes are compared in order, and consolidation writes the model's order).
/// That order is the model's at ep 1: a sparse layer's experts 0..E in turn. `Ep` gives rank
/// r the consecutive block r E/ep..(r+1) E/ep of each sparse layer, so at rank r a layer's
/// run of expert parameters (n of them) is the r-th of ep equal blocks, and
/// `held_elsewhere` names the other blocks of each layer in layer and expert order. The
/// whole run is then: the next r n parameters held elsewhere (ranks 0..r), this rank's run,
/// the next (ep - 1 - r) n (ranks r+1..ep), block j belonging to rank j. Each parameter
/// taken from elsewhere must have the shape of its counterpart in this rank's run (the
/// same projection of another expert), and takes its split, as all experts are split
/// alike; a model whose `held_elsewhere` does not follow this is an error, reported when
/// a checkpoint is saved or loaded (training does not need the list).
pub(crate) fn whole_model(
    mine: Vec<Declared>,
    elsewhere: &[ParamSpec],
    (rank, ep): (usize, usize),
) -> std::result::Result<Vec<Placed>, String> {
    if ep == 1 {
        let placed = mine.into_iter().map(|(spec, _, stage)| Placed {
            spec,
            stage,
            holder: None,
        });
        return Ok(placed.collect());
    }
    let mut others = elsewhere.iter();
    let mut out = Vec::with_capacity(mine.len() + elsewhere.len());
    let mut at = 0;
    while at < mine.len() {
        let (spec, layer, stage) = &mine[at];
        if !spec.expert {
            let (spec, stage) = (spec.clone(), *stage);
            out.push(Placed {
                spec,
                stage,
                holder: None,
            });
            at += 1;
            continue;
        }
        let n = mine[at..]
            .iter()
            .take_while(|(p, l, _)| p.expert && l == layer)
            .count();
        for holder in 0..ep {
            for (p, _, stage) in &mine[at..at + n] {
                let spec = match holder == rank {
                    true => p.clone(),
                    false => counterpart(others.next(), p, holder)?,
                };
                out.push(Placed {
                    spec,
                    stage: *stage,
                    holder: Some(holder),
                });
            }
        }
        at += n;
    }
    match others.next() {
        None => Ok(out),
        Some(extra) => Err(mismatch(format!(
            "{} is held elsewhere but follows no expert of this rank",
            extra.name
        ))),
    }
}

/// Expert parallel rank `holder`'s parameter corresponding to this rank's `p`.
fn counterpart(
    other: Option<&ParamSpec>,
    p: &ParamSpec,
    holder: usize,
) -> std::result::Result<ParamSpec, String> {
    let other = other.ok_or_else(|| {
        mismatch(format!(
            "expert-parallel rank {holder}'s counterpart of {} is not among them",
            p.name
        ))
    })?;
    if other.shape != p.shape {
        return Err(mismatch(format!(
            "{} {:?} held by expert-parallel rank {holder} in the place of {} {:?}",
            other.name, other.shape, p.name, p.shape
        )));
    }
    Ok(ParamSpec {
        name: other.name.clone(),
        ..p.clone()
    })
}

fn mismatch(what: String) -> String {
    format!(
        "the model's experts held elsewhere (Model::held_elsewhere) do not follow expert parallelism's layout, \
         each rank a consecutive block of every sparse layer's experts: {what}"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Init;

    /// Layer `layer`'s experts `experts` as (gate, down) specs, marked.
    fn experts(layer: usize, experts: std::ops::Range<usize>) -> Vec<ParamSpec> {
        experts
            .flat_map(|e| {
                let name = |w: &str| format!("l{layer}.experts.{e}.{w}");
                [
                    ParamSpec::new(&name("gate"), &[4, 2], Init::Zeros).expert(),
                    ParamSpec::new(&name("down"), &[2, 4], Init::Zeros).expert(),
                ]
            })
            .collect()
    }

    /// Two sparse layers of 4 experts, a dense router before each and a head after, as
    /// expert-parallel rank `rank` of `ep` declares them.
    fn declared(rank: usize, ep: usize) -> (Vec<Declared>, Vec<ParamSpec>) {
        let per = 4 / ep;
        let mut mine = Vec::new();
        let mut elsewhere = Vec::new();
        for layer in 0..2 {
            let router = ParamSpec::new(&format!("l{layer}.router"), &[4, 2], Init::Zeros);
            mine.push((router, layer, layer));
            let local = rank * per..(rank + 1) * per;
            mine.extend(
                experts(layer, local.clone())
                    .into_iter()
                    .map(|p| (p, layer, layer)),
            );
            let others = (0..4).filter(|e| !local.contains(e));
            elsewhere.extend(others.flat_map(|e| experts(layer, e..e + 1)));
        }
        mine.push((ParamSpec::new("head", &[3], Init::Zeros), 2, 1));
        (mine, elsewhere)
    }

    fn names(placed: &[Placed]) -> Vec<(String, Option<usize>)> {
        placed
            .iter()
            .map(|p| (p.spec.name.clone(), p.holder))
            .collect()
    }

    #[test]
    fn every_rank_of_every_ep_lists_the_model_of_ep_1() {
        let (one, none) = declared(0, 1);
        let want = whole_model(one, &none, (0, 1)).unwrap();
        assert!(want.iter().all(|p| p.holder.is_none()));
        assert_eq!(want.len(), 2 * (1 + 8) + 1);
        for ep in [2, 4] {
            for rank in 0..ep {
                let (mine, elsewhere) = declared(rank, ep);
                let got = whole_model(mine, &elsewhere, (rank, ep)).unwrap();
                let plain: Vec<&str> = got.iter().map(|p| p.spec.name.as_str()).collect();
                let expected: Vec<&str> = want.iter().map(|p| p.spec.name.as_str()).collect();
                assert_eq!(plain, expected, "rank {rank} of ep {ep}");
                let stages: Vec<usize> = got.iter().map(|p| p.stage).collect();
                let expected: Vec<usize> = want.iter().map(|p| p.stage).collect();
                assert_eq!(stages, expected, "rank {rank} of ep {ep}");
                // expert e of each layer belongs to rank e / (4 / ep)
                for (name, holder) in names(&got) {
                    let e = name.split('.').nth(2).and_then(|e| e.parse::<usize>().ok());
                    assert_eq!(holder, e.map(|e| e / (4 / ep)), "{name} at ep {ep}");
                }
            }
        }
    }

    #[test]
    fn experts_held_elsewhere_that_do_not_follow_the_layout_are_an_error() {
        let (mine, mut elsewhere) = declared(1, 2);
        let short = whole_model(mine.clone(), &elsewhere[1..], (1, 2)).unwrap_err();
        assert!(short.contains("do not follow"), "{short}");
        elsewhere[0].shape = vec![5, 2];
        let shape = whole_model(mine.clone(), &elsewhere, (1, 2)).unwrap_err();
        assert!(shape.contains("l0.experts.0.gate [5, 2]"), "{shape}");
        elsewhere[0].shape = vec![4, 2];
        elsewhere.push(ParamSpec::new("stray", &[1], Init::Zeros));
        let extra = whole_model(mine, &elsewhere, (1, 2)).unwrap_err();
        assert!(extra.contains("stray"), "{extra}");
    }
}
