"""A team's registered jobs (`[jobs.NAME]` of TRAINWISE_PROJECT_FILE) as one asset and one job.

`user_job_run` launches the job chosen in the Launchpad (a drop-down of the registered names)
through the selected provider (`trainwise.user_jobs`): preflight before any node, the nodes of
a `GangSession`, reclaims answered with a checkpoint to the object store and a resume on the
replacement. Its metadata is the outcome, the provider's bill, the segments and the launch's
forecast (P50/P90 USD and hours): a launch whose forecast P90 exceeds the published schedule's
budget is refused before any node unless it gives `budget_override_reason`
(`trainwise.user_job_forecast`). With an
`allocation_policy` the policy holds the nodes on the replayed spot trace instead of the fixed
market (`trainwise.user_job_supervised`, the train job's engine). Absent when the project file
registers no job (the code location then shows neither the asset nor the job).
"""

import enum
from collections.abc import Mapping

import dagster as dg

from assets.data import data_shards
from assets.resources import MLflowResource, ObjectStoreResource, StateResource
from trainwise import (
    agent_launch,
    gang,
    job_forecast,
    settings,
    user_job_forecast,
    user_job_supervised,
    user_jobs,
)
from trainwise import schedule as schedule_lib
from trainwise.object_store import LocalObjectStore, store_location
from trainwise.sdk.spec import RunSpec
from trainwise.user_project import JobSpec, Project

JOB_NAME = "train_user_job"


def user_job_defs(project: Project, shards_asset: dg.AssetsDefinition = data_shards
                  ) -> dict[str, list]:
    """The asset and the job for `project`'s registered jobs; empty lists when it has none."""
    if not project.jobs:
        return {"assets": [], "jobs": []}
    jobs: Mapping[str, JobSpec] = project.jobs
    # The Launchpad shows an Enum field as a drop-down: the registered jobs, nothing else.
    registered = enum.Enum("RegisteredJob", {name: name for name in jobs})
    first = next(iter(registered))

    class UserJobConfig(dg.Config):
        job: registered = first  # type: ignore[valid-type]
        """The registered job to launch ([jobs.NAME] of the project file)."""
        run_id: str = ""
        """The training run's id; empty: <job>-<the Dagster run's id>. The same id resumes."""
        max_steps: int = 0
        """Optimizer steps; 0: the job decides (it calls run.finish())."""
        market: str = "spot"
        """spot or on-demand, for the node the job runs on (when allocation_policy is empty)."""
        nodes: int = 1
        """Nodes of the job's gang, one rank each under torchrun (its script joins the process
        group through trainwise.init()). More than one needs a provider whose nodes run the
        node agent (aws); the emulated provider runs the job as one process."""
        allocation_policy: str = ""
        """Empty: the node is `market`, launched as asked. A registered allocation policy
        (on_demand, managed_spot, uniform_progress, trainwise_heuristic): it holds spot,
        on-demand or nothing at every tick of the emulated provider's replayed spot trace, the
        train job's engine (trainwise/user_job_supervised.py); needs max_steps."""
        seed: int = 0
        checkpoint_every_steps: int = 100
        first_step_timeout_s: float = 300.0
        """The job must call run.step() within this many seconds of its start."""
        budget_override_reason: str = ""
        """Launch although the forecast P90 exceeds the published schedule's budget_usd; the
        reason is recorded with the run (its tags and launch_forecast.json)."""

    @dg.asset(name="user_job_run", group_name="user_jobs", deps=[shards_asset],
              kinds={"pytorch"})
    def user_job_run(context: dg.AssetExecutionContext, config: UserJobConfig,
                     state: StateResource, object_store: ObjectStoreResource,
                     mlflow: MLflowResource) -> dg.MaterializeResult:
        """A registered job of the team's project file, trained on the provider's nodes."""
        job = jobs[config.job.value]
        project_dir = project.path.parent if project.path is not None else state.path()
        store = object_store.store()
        if config.allocation_policy and not isinstance(store, LocalObjectStore):
            raise dg.Failure(description=(
                "a registered job under an allocation_policy (the supervised engine) reads its "
                "checkpoints from a local object store folder only for now; unset "
                "TRAINWISE_S3_BUCKET, or leave allocation_policy empty (the SDK and the node "
                "agent checkpoint to S3)"))
        on_nodes = agent_launch.runs_on_nodes()
        if config.nodes > 1 and (config.allocation_policy or not on_nodes):
            raise dg.Failure(description=(
                f"nodes={config.nodes}: a gang of a registered job runs on nodes that run the "
                "node agent (TRAINWISE_PROVIDER=aws) on a fixed market; "
                + ("leave allocation_policy empty" if config.allocation_policy else
                   f"the {gang.provider_name()} provider runs the job as one process")
                + ", or set nodes=1 (nothing was launched)"))
        try:
            user_jobs.preflight(job, project_dir, state.path("shards", job.dataset))
        except user_jobs.UserJobError as error:
            raise dg.Failure(description=str(error)) from error
        run_id = config.run_id or f"{job.name}-{context.run.run_id[:8]}"
        run_dir = state.path("runs", run_id)
        instance_type = settings.get("TRAINWISE_INSTANCE_TYPE")
        region = settings.get("TRAINWISE_REGION")
        published = schedule_lib.published(state.path())
        spec = RunSpec(run_id=run_id, run_dir=str(run_dir), seed=config.seed,
                       max_steps=config.max_steps or None,
                       checkpoint_every_steps=config.checkpoint_every_steps or None,
                       store_root=store_location(store), instance_type=instance_type,
                       schedule_version=published.version,
                       dataset_dir=str(state.path("shards", job.dataset)))
        context.instance.add_run_tags(context.run.run_id, {"trainwise/training_run": run_id,
                                                           "trainwise/user_job": job.name})
        # The budget: the forecast before any node; over budget refused unless a reason is given.
        try:
            launch = user_job_forecast.launch_gate(
                state.path(), job, project_dir, user_job_forecast.ask_for(
                    job.name, max_steps=config.max_steps, market=config.market,
                    allocation_policy=config.allocation_policy, run_id=run_id,
                    checkpoint_every_steps=config.checkpoint_every_steps,
                    budget_override_reason=config.budget_override_reason, nodes=config.nodes),
                published, state.path("shards", job.dataset))
        except job_forecast.BudgetExceededError as refused:
            raise dg.Failure(description=str(refused), metadata={
                **{k: v for k, v in refused.record.items() if k != "forecast"},
                "forecast": dg.MetadataValue.json(refused.record["forecast"])}) from refused
        except ValueError as error:  # an unknown market or policy; work the trace cannot hold
            raise dg.Failure(description=str(error)) from error
        context.log.info(launch.get("summary") or launch.get("skipped", ""))
        if launch.get("override_reason"):
            context.instance.add_run_tags(context.run.run_id, {
                "trainwise/budget_override": launch["override_reason"][:250]})
        if config.allocation_policy:  # the supervised engine, as the train job's
            try:
                result = user_job_supervised.supervise_user_job(
                    job, project_dir, spec, user_job_supervised.replay_for_run(),
                    config.allocation_policy).result
            except ValueError as error:  # unknown policy, no max_steps: nothing launched
                raise dg.Failure(description=str(error)) from error
        else:
            # aws: the nodes boot the node agent, which runs the job there (agent_launch);
            # the emulated provider's nodes are this machine (user_jobs.UserJobLaunch).
            node_agent = ({"run_id": run_id, "store_root": store_location(store),
                           "job": job.name}
                          if on_nodes else {})
            session = gang.GangSession(
                gang.provider_for_run(instance_type, region, **node_agent),
                gang.Allocation(market=config.market, nodes=config.nodes,
                                reason="the Launchpad's request", source="request"),
                instance_type, run_dir, run_id, region=region,
                schedule_version=published.version)
            try:
                launcher = (agent_launch.AgentJobLaunch(
                                job, project_dir, session, spec,
                                first_step_timeout_s=config.first_step_timeout_s)
                            if on_nodes else user_jobs.UserJobLaunch(
                                job, project_dir, session, spec,
                                first_step_timeout_s=config.first_step_timeout_s))
                result = launcher.run()
            except ValueError as error:  # a task the agent would refuse: no node launched
                raise dg.Failure(description=str(error)) from error
        metadata = {"status": result["status"], "run_id": run_id, "job": job.name,
                    "entry": job.entry, "dataset": job.dataset,
                    "steps": result["steps"], "reclaims": result["reclaims"] or 0,
                    "cost_usd": result["cost_usd"],
                    "segments": dg.MetadataValue.json(result["segments"]),
                    "allocation_policy": config.allocation_policy or "(fixed market)",
                    "run_dir": dg.MetadataValue.path(str(run_dir)),
                    **user_job_forecast.forecast_metadata(launch)}
        try:
            mlflow_run_id = user_jobs.log_to_mlflow(mlflow.uri(), mlflow.experiment, result,
                                                    job, spec)
            metadata["mlflow_run_id"] = mlflow_run_id
        except Exception as error:  # the trained model stays; the record says what is missing
            context.log.warning(f"MLflow logging failed ({type(error).__name__}: {error})")
            metadata["mlflow_pending"] = f"{type(error).__name__}: {error}"[:300]
        if result["status"] != "completed":
            raise dg.Failure(description=result["failure"], metadata=metadata,
                             allow_retries=True)
        context.log.info(f"job {job.name} completed in {result['steps']} steps, "
                         f"{len(result['segments'])} segment(s), bill {result['cost_usd']} USD")
        return dg.MaterializeResult(metadata=metadata)

    train_user_job = dg.define_asset_job(
        JOB_NAME, selection=dg.AssetSelection.assets(user_job_run),
        description="Launch one of the team's registered jobs (its project file) on the "
                    "provider's nodes, preemptions answered, the bill recorded.")
    return {"assets": [user_job_run], "jobs": [train_user_job]}
