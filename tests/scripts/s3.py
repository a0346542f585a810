#!/usr/bin/env python3
"""A plain S3 client (boto3) for the object tier tests: it checks what
converged wrote with code that is not converged's.

usage: s3.py ENDPOINT mkbucket BUCKET
       s3.py ENDPOINT put BUCKET KEY FILE
       s3.py ENDPOINT get BUCKET KEY FILE      (exit 3 when the key is missing)
       s3.py ENDPOINT list BUCKET PREFIX        (one key per line)
"""
import os
import sys

import boto3
from botocore.exceptions import ClientError


def main():
    endpoint, cmd, *args = sys.argv[1:]
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                      aws_access_key_id=os.environ.get("AWS_ACCESS_KEY_ID", "test"),
                      aws_secret_access_key=os.environ.get("AWS_SECRET_ACCESS_KEY", "test"))
    if cmd == "mkbucket":
        s3.create_bucket(Bucket=args[0])
    elif cmd == "put":
        with open(args[2], "rb") as f:
            s3.put_object(Bucket=args[0], Key=args[1], Body=f.read())
    elif cmd == "get":
        try:
            body = s3.get_object(Bucket=args[0], Key=args[1])["Body"].read()
        except ClientError as e:
            if e.response["Error"]["Code"] in ("NoSuchKey", "404"):
                sys.exit(3)
            raise
        with open(args[2], "wb") as f:
            f.write(body)
    elif cmd == "list":
        pages = s3.get_paginator("list_objects_v2").paginate(Bucket=args[0], Prefix=args[1])
        for page in pages:
            for o in page.get("Contents", []):
                print(o["Key"])
    else:
        sys.exit(f"unknown command {cmd}")


if __name__ == "__main__":
    main()
