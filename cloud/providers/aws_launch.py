"""What an `aws` node is launched with, from the settings, checked before any launch.

A node that runs the run's job needs an AMI with trainwise installed, an instance profile (its
credentials: the node reads and writes the store and never gets keys in its user-data), a
subnet in the zone the run is placed in, and security groups (the gang's hosts reach each
other through them). `LaunchSettings.from_settings()` reads them; `problems()` lists every one
that is missing or malformed at once, each with the setting, what it is for and the fix, so
that `AwsProvider.preflight` refuses a run before any node is billed. Nothing here calls AWS:
an id of the right form that does not exist is found at the first launch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from cloud.providers.aws_user_data import DEFAULT_AGENT_COMMAND, agent_argv

IMAGE_SETTING = "TRAINWISE_EC2_IMAGE_ID"
IMAGE_PARAMETER_SETTING = "TRAINWISE_EC2_IMAGE_PARAMETER"
PROFILE_SETTING = "TRAINWISE_EC2_INSTANCE_PROFILE"
SUBNETS_SETTING = "TRAINWISE_EC2_SUBNET_IDS"
SECURITY_GROUPS_SETTING = "TRAINWISE_EC2_SECURITY_GROUP_IDS"
TAGS_SETTING = "TRAINWISE_EC2_TAGS"
AGENT_COMMAND_SETTING = "TRAINWISE_EC2_AGENT_COMMAND"
SETTING_NAMES = (IMAGE_SETTING, IMAGE_PARAMETER_SETTING, PROFILE_SETTING, SUBNETS_SETTING,
                 SECURITY_GROUPS_SETTING, TAGS_SETTING, AGENT_COMMAND_SETTING)

_IMAGE_ID = re.compile(r"ami-[0-9a-f]{8,17}")
_SUBNET_ID = re.compile(r"subnet-[0-9a-f]{8,17}")
_GROUP_ID = re.compile(r"sg-[0-9a-f]{8,17}")
_PARAMETER = re.compile(r"[A-Za-z0-9_.\-/]{1,2048}")
_PROFILE_NAME = re.compile(r"[\w+=,.@-]{1,128}")
_PROFILE_ARN = re.compile(r"arn:aws[a-z-]*:iam::\d{12}:instance-profile/[\w+=,.@/-]{1,512}")
_TAG_KEY = re.compile(r"[\w .:+=@/-]{1,128}")
_TAG_VALUE = re.compile(r"[\w .:+=@/-]{0,256}")
# Keys that are not the user's: AWS reserves aws:, and trainwise:* are the provider's own.
RESERVED_TAG_PREFIXES = ("aws:", "trainwise:")
MAX_EXTRA_TAGS = 40  # EC2 allows 50 per resource; the provider's own take a few


@dataclass(frozen=True)
class LaunchSettings:
    """The launch fields of the settings, as given (checked by `problems`)."""

    image_id: str = ""
    image_parameter: str = ""
    instance_profile: str = ""
    subnet_ids: tuple[str, ...] = ()
    security_group_ids: tuple[str, ...] = ()
    tags: str = ""
    agent_command: str = DEFAULT_AGENT_COMMAND

    @classmethod
    def from_settings(cls) -> LaunchSettings:
        from trainwise import settings

        raw = {name: settings.get(name) for name in SETTING_NAMES}
        return cls(image_id=raw[IMAGE_SETTING].strip(),
                   image_parameter=raw[IMAGE_PARAMETER_SETTING].strip(),
                   instance_profile=raw[PROFILE_SETTING].strip(),
                   subnet_ids=split_ids(raw[SUBNETS_SETTING]),
                   security_group_ids=split_ids(raw[SECURITY_GROUPS_SETTING]),
                   tags=raw[TAGS_SETTING].strip(), agent_command=raw[AGENT_COMMAND_SETTING])

    def problems(self) -> list[str]:
        """Every missing or malformed launch setting, each naming the setting, its use and the
        fix; [] when a node can be launched."""
        checks = (self._image_problems, self._profile_problems, self._subnet_problems,
                  self._group_problems, self._tag_problems, self._agent_problems)
        return [problem for check in checks for problem in check()]

    def _image_problems(self) -> list[str]:
        use = ("the AMI the nodes boot, with trainwise installed so that the node agent starts, "
               "see docs/agent.md")
        if self.image_id and self.image_parameter:
            return [f"{IMAGE_SETTING} and {IMAGE_PARAMETER_SETTING} are both set ({use}); "
                    "give one of them"]
        if self.image_parameter:
            return _form(IMAGE_PARAMETER_SETTING, self.image_parameter, _PARAMETER, use,
                         "an SSM parameter name such as /trainwise/node-ami")
        if not self.image_id:
            return [f"{IMAGE_SETTING} is empty: {use}; set it to the AMI id (ami-...) of the "
                    f"region, or set {IMAGE_PARAMETER_SETTING} to an SSM parameter holding one"]
        return _form(IMAGE_SETTING, self.image_id, _IMAGE_ID, use, "an AMI id such as ami-0abc1234")

    def _profile_problems(self) -> list[str]:
        use = ("the IAM instance profile of the nodes, their credentials for the object store: "
               "user-data never carries keys")
        if not self.instance_profile:
            return [f"{PROFILE_SETTING} is empty: {use}; set it to the profile's name or ARN"]
        pattern = _PROFILE_ARN if self.instance_profile.startswith("arn:") else _PROFILE_NAME
        return _form(PROFILE_SETTING, self.instance_profile, pattern, use,
                     "a profile name or arn:aws:iam::ACCOUNT:instance-profile/NAME")

    def _subnet_problems(self) -> list[str]:
        use = ("the subnets the nodes are launched in, one per zone a run may be placed in: "
               "a subnet lives in one zone")
        if not self.subnet_ids:
            return [f"{SUBNETS_SETTING} is empty: {use}; set it to comma-separated subnet ids"]
        return _each_form(SUBNETS_SETTING, self.subnet_ids, _SUBNET_ID, use, "subnet-0abc1234")

    def _group_problems(self) -> list[str]:
        use = ("the security groups of the nodes, in the subnets' VPC: the gang's hosts reach "
               "each other and the store through them")
        if not self.security_group_ids:
            return [f"{SECURITY_GROUPS_SETTING} is empty: {use}; set it to comma-separated "
                    "security group ids"]
        return _each_form(SECURITY_GROUPS_SETTING, self.security_group_ids, _GROUP_ID, use,
                          "sg-0abc1234")

    def _tag_problems(self) -> list[str]:
        try:
            parse_tags(self.tags)
        except ValueError as error:
            return [str(error)]
        return []

    def _agent_problems(self) -> list[str]:
        try:
            agent_argv(self.agent_command)
        except ValueError as error:
            return [str(error)]
        return []


def split_ids(value: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in value.split(",") if part.strip())


def parse_tags(value: str) -> dict[str, str]:
    """TRAINWISE_EC2_TAGS, `KEY=VALUE,KEY=VALUE`, as a dict; raises ValueError naming the
    setting and the pair."""
    fix = (f"set {TAGS_SETTING} to comma-separated KEY=VALUE pairs (letters, digits, spaces and "
           "_ . : + = @ / -), keys not starting with aws: or trainwise:")
    tags: dict[str, str] = {}
    for pair in (p.strip() for p in value.split(",") if p.strip()):
        key, sep, tag_value = (part.strip() for part in pair.partition("="))
        if not sep or not _TAG_KEY.fullmatch(key) or not _TAG_VALUE.fullmatch(tag_value):
            raise ValueError(f"{TAGS_SETTING}: {pair!r} is not a KEY=VALUE tag; {fix}")
        if key.lower().startswith(RESERVED_TAG_PREFIXES):
            raise ValueError(f"{TAGS_SETTING}: key {key!r} is reserved; {fix}")
        if key in tags:
            raise ValueError(f"{TAGS_SETTING}: key {key!r} is given twice; {fix}")
        tags[key] = tag_value
    if len(tags) > MAX_EXTRA_TAGS:
        raise ValueError(f"{TAGS_SETTING} has {len(tags)} tags, more than {MAX_EXTRA_TAGS}; "
                         "EC2 allows 50 per instance and the provider adds its own")
    return tags


def _form(setting: str, value: str, pattern: re.Pattern[str], use: str, example: str
          ) -> list[str]:
    if pattern.fullmatch(value):
        return []
    return [f"{setting}={value!r} is not of the form {example} ({use})"]


def _each_form(setting: str, values: tuple[str, ...], pattern: re.Pattern[str], use: str,
               example: str) -> list[str]:
    bad = [v for v in values if not pattern.fullmatch(v)]
    if not bad:
        return []
    return [f"{setting} has {', '.join(repr(v) for v in bad)}, not of the form {example} "
            f"({use})"]


def instance_profile_field(profile: str) -> dict[str, Any]:
    """run_instances' IamInstanceProfile: by ARN when given one, else by name."""
    return {"Arn": profile} if profile.startswith("arn:") else {"Name": profile}
