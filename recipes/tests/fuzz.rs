//! Fuzzing the recipe parser: inputs mutated from the shipped recipes for `COPUS_FUZZ_SECS`
//! (default 3 s). A recipe must parse or be refused with an error, never panic; the allocator is
//! capped (2 GiB live), so an input that makes the parser allocate without bound aborts.

#![forbid(unsafe_code)]

use copus_tests::fuzz::{budget, fuzz};
use recipes::recipe::Recipe;

#[global_allocator]
static ALLOCATOR: cap::Cap<std::alloc::System> = cap::Cap::new(std::alloc::System, 2 << 30);

#[test]
fn recipes_parse_or_are_refused() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let seeds: Vec<Vec<u8>> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "ron"))
        .filter_map(|p| {
            let text = std::fs::read_to_string(&p).ok()?;
            // Training recipes only (comparison and suite files have other schemas).
            Recipe::parse(&text, "seed").is_ok().then(|| text.into_bytes())
        })
        .collect();
    assert!(seeds.len() >= 2, "the shipped training recipes are the seeds");
    let runs = fuzz("recipes", &seeds, budget(), |bytes| {
        let _ = Recipe::parse(&String::from_utf8_lossy(bytes), "fuzz");
    });
    assert!(runs >= seeds.len() as u64);
}
