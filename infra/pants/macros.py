# Pants BUILD-file prelude (pants.toml `build_file_prelude_globs`): one call per wheel.


def mt_distribution(name, description, extras_require=None, entry_points=None,
                    dependencies=(), version="0.1.0"):
    """The wheel of one mt package or app, built from the `lib` target next to it.

    Requires-Dist is inferred from what the sources import: third-party ranges from
    infra/python/requirements.txt, sibling mt packages as `~=version`.
    """
    artifact = dict(
        name=name,
        version=version,
        description=description,
        license="Apache-2.0",
        python_requires=">=3.11",
    )
    if extras_require:
        artifact["extras_require"] = extras_require
    python_distribution(  # noqa: F821 (a Pants BUILD symbol)
        name="dist",
        dependencies=[":lib", *dependencies],
        provides=python_artifact(**artifact),  # noqa: F821
        entry_points=entry_points or {},
        generate_setup=True,
        sdist=False,
    )
