from setuptools import find_packages, setup

setup(
    name="tf_gradsync",
    version="0.1.0",
    description="Compressed, bucketed gradient all-reduce for tf.distribute",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    # The presets of configs/ install as tf_gradsync/configs, where `load_config` finds
    # them by name.
    packages=find_packages(include=["tf_gradsync", "tf_gradsync.*"]) + ["tf_gradsync.configs"],
    package_dir={"tf_gradsync.configs": "configs"},
    package_data={"tf_gradsync.configs": ["*.yaml"]},
    python_requires=">=3.9",
    install_requires=["tensorflow>=2.16", "numpy", "absl-py", "pyyaml"],
    extras_require={
        "test": ["pytest", "pytest-xdist", "scikit-learn", "tf_keras", "hypothesis", "matplotlib", "tensorboard"],
        "examples": ["scikit-learn"],
        "report": ["matplotlib"],
        "tensorboard": ["tensorboard"],   # CommunicationMonitor(tensorboard_dir=...)
        "bench": ["matplotlib", "scikit-learn"],   # --png; the accuracy suite
    },
)
