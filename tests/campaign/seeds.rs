//! The seeds the campaign replays in `./dev test` (and so in CI): each found a defect or a
//! checker flaw once (docs/RELIABILITY.md tells which), or ran clean as a control. A seed
//! fixes the nemesis' and the load's choices, not their timing, so a replay is not the
//! run that found the defect; it is a fixed, repeatable gate. New seeds are explored with
//! `./dev campaign` (`AX_CAMPAIGN_SEED=random`), and a seed that finds something joins
//! this list with its fix.

/// Single-node seeds: (seed, what it found).
pub const SINGLE_NODE: &[(u64, &str)] = &[
    (
        16930899215256229720,
        "pause: a worker started during a pause ran tasks (A), a gated delivery started after a pause (B)",
    ),
    (
        7997574421656072346,
        "retry: a claimed attempt waiting out a pause was lost with its worker",
    ),
];

/// R3 cluster seeds: (seed, what it found).
pub const R3_CLUSTER: &[(u64, &str)] = &[
    (
        12035618627834268037,
        "run now: the checker demanded a start 5 s before a due time the acknowledgement came after (issue 43)",
    ),
    (
        4955772603497125947,
        "a flow run never driven (D), rate starts bunched after a node restart",
    ),
];

/// The seeds to run: the fixed list of the variant when `env` (`AX_CAMPAIGN_SEED`) is
/// unset or empty; else the seeds it names, comma-separated, where `random` draws a new
/// one.
pub fn chosen(cluster: bool, env: Option<&str>) -> Result<Vec<u64>, String> {
    let fixed = if cluster { R3_CLUSTER } else { SINGLE_NODE };
    let Some(text) = env.map(str::trim).filter(|t| !t.is_empty()) else {
        return Ok(fixed.iter().map(|(seed, _)| *seed).collect());
    };
    text.split(',')
        .map(|one| match one.trim() {
            "random" => Ok(rand::random()),
            n => n.parse().map_err(|_| {
                format!("AX_CAMPAIGN_SEED: {n:?} is neither a seed (an unsigned 64-bit integer) nor `random`")
            }),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unset_means_the_fixed_list_and_seeds_replay_as_given() {
        assert_eq!(chosen(false, None).unwrap().len(), SINGLE_NODE.len());
        assert_eq!(chosen(true, Some(" ")).unwrap()[0], R3_CLUSTER[0].0);
        assert_eq!(chosen(true, Some("7, 9")).unwrap(), vec![7, 9]);
        assert_eq!(chosen(true, Some("random,random")).unwrap().len(), 2);
        assert!(chosen(true, Some("-1")).unwrap_err().contains("\"-1\""));
    }
}
