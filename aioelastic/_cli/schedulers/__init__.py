"""What a scheduler's environment says about the job: SLURM steps and Kubernetes pods.

Read by the command line's parser for whatever the user did not say with a flag or a
``PET_*`` variable (`._derive`): SLURM's node lists (`._hostlist`), a step's node count,
node id and ids (`._slurm`), a pod's ``MASTER_ADDR``/``MASTER_PORT`` (`._kubernetes`).
Empty of imports on purpose.
"""
