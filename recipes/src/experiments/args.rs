//! `recipes compare`'s arguments: a comparison recipe or a suite file.

use std::path::PathBuf;

use super::{compare, suite};
use crate::Usage;

/// Run every policy of a comparison recipe side by side and write the report; with
/// `--suite`, every scenario of a suite file over its seeds, in one table.
#[derive(clap::Args)]
pub struct CompareArgs {
    /// The comparison recipe (RON), e.g. recipes/compare-synthetic-3b.ron.
    #[arg(required_unless_present = "suite", conflicts_with = "suite")]
    recipe: Option<PathBuf>,
    /// A suite file (RON), e.g. recipes/suite-paper.ron.
    #[arg(long)]
    suite: Option<PathBuf>,
}

impl CompareArgs {
    /// `recipes compare`: runs the comparison (or the suite) and prints its table and report
    /// folder.
    pub fn exec(self) -> anyhow::Result<()> {
        match (self.suite, self.recipe) {
            (Some(path), _) => {
                let s = suite::Suite::load(&path).map_err(|e| Usage(e.to_string()))?;
                let (folder, table) = suite::run(&s)?;
                println!("{table}");
                println!("report: {}", folder.display());
            }
            (None, Some(path)) => {
                let r = compare::CompareRecipe::load(&path).map_err(|e| Usage(e.to_string()))?;
                let out = compare::run(&r)?;
                println!("{}", out.summary);
                println!("report: {}", out.folder.display());
            }
            (None, None) => return Err(Usage("give a comparison recipe or --suite FILE".into()).into()),
        }
        Ok(())
    }
}
