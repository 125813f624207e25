//! `recipes compare`'s arguments: a comparison recipe, a suite file or an evidence file.

use std::path::PathBuf;

use super::{compare, evidence, suite};
use crate::Usage;

/// Run every policy of a comparison recipe side by side and write the report; with
/// `--suite`, every scenario of a suite file over its seeds, in one table; with `--evidence`,
/// a pre-registered comparison on a suite's scenarios.
#[derive(clap::Args)]
pub struct CompareArgs {
    /// The comparison recipe (RON), e.g. recipes/compare-synthetic-3b.ron.
    #[arg(required_unless_present_any = ["suite", "evidence"], conflicts_with_all = ["suite", "evidence"])]
    recipe: Option<PathBuf>,
    /// A suite file (RON), e.g. recipes/suite-paper.ron.
    #[arg(long, conflicts_with = "evidence")]
    suite: Option<PathBuf>,
    /// An evidence file (RON), e.g. recipes/evidence-structured.ron.
    #[arg(long)]
    evidence: Option<PathBuf>,
    /// With `--evidence`: the structured truth on the development seeds alone, baselines
    /// chosen and Copus judged there (for developing a rule; the test seeds stay fresh).
    #[arg(long, requires = "evidence")]
    development: bool,
}

impl CompareArgs {
    /// `recipes compare`: runs the comparison (or the suite, or the evidence file) and prints
    /// its table and report folder.
    pub fn exec(self) -> anyhow::Result<()> {
        match (self.suite, self.evidence, self.recipe) {
            (Some(path), _, _) => {
                let s = suite::Suite::load(&path).map_err(|e| Usage(e.to_string()))?;
                let (folder, table) = suite::run(&s)?;
                println!("{table}");
                println!("report: {}", folder.display());
            }
            (None, Some(path), _) => {
                let (e, s) = evidence::Evidence::load(&path).map_err(|e| Usage(format!("{e:#}")))?;
                let (folder, report) = evidence::run(&e, &s, self.development)?;
                println!("{report}");
                println!("report: {}", folder.display());
            }
            (None, None, Some(path)) => {
                let r = compare::CompareRecipe::load(&path).map_err(|e| Usage(e.to_string()))?;
                let out = compare::run(&r)?;
                println!("{}", out.summary);
                println!("report: {}", out.folder.display());
            }
            (None, None, None) => return Err(Usage("give a comparison recipe, --suite FILE or --evidence FILE".into()).into()),
        }
        Ok(())
    }
}
